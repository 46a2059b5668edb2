"""`rapidformer eval` and `rapidformer predict` on tiny runs trained in this process: eval's
numbers are the training log's for the same checkpoint (and for other data named by overrides),
predict writes one row per input row with labels, tags and answers the run knows, from a
checkpoint, from the exported model and from a run without an export; bad input files, missing
columns, damaged checkpoints and tasks predict does not cover end with one message and a
non-zero exit code."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import read_metrics
from tests.test_verbs import cli  # (exit code, stdout, stderr) of `rapidformer ARGV`

# a few steps of a tiny BERT: seconds each on a CPU
TINY = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=1",
        "model=bert_tiny", "model.vocab_size=300", "model.hidden_size=32",
        "model.intermediate_size=64", "trainer.micro_batch_size=16",
        "trainer.global_batch_size=16", "trainer.lr=2e-3", "trainer.epochs=null"]


def train(run: Path, *overrides: str) -> Path:
    """A run trained in this process."""
    from rapidformer import __main__ as module_main

    module_main.main([*TINY, *overrides, f"trainer.output_dir={run}"])
    return run




def one_error(err: str) -> str:
    """The one error line of a refused command (and no traceback)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("rapidformer: error:")]
    assert len(lines) == 1, err
    return lines[0]


def logged(run: Path, step: int, prefix: str = "validation/") -> dict:
    """The metrics the run logged for `prefix` at `step`."""
    return {k: v for r in read_metrics(run) if r["step"] == step
            for k, v in r.items() if k.startswith(prefix)}


def assert_same_metrics(got: dict, expected: dict) -> None:
    assert set(got) == set(expected) and expected, (got, expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- sequence classification, with label names ---------------------------------------------------

@pytest.fixture(scope="module")
def named_pairs(tmp_path_factory, pairs_dir) -> Path:
    """The session's generated pairs with their labels as names, and a labelled test split."""
    out = tmp_path_factory.mktemp("named_pairs")
    for split in ("train", "validation", "test"):
        rows = read_jsonl(pairs_dir / f"{split}.jsonl")
        (out / f"{split}.jsonl").write_text("".join(
            json.dumps({**r, "label": ["different", "same"][int(r["label"])]}) + "\n"
            for r in rows[:64 if split == "train" else 32]))
    return out


@pytest.fixture(scope="module")
def cls_run(tmp_path_factory, named_pairs) -> Path:
    """Checkpoints at steps 3 and 6, each evaluated; the test split scored at the end."""
    return train(tmp_path_factory.mktemp("cls") / "run", "data=pairs_local",
                 f"data.path={named_pairs}", "data.max_seq_length=32",
                 "trainer.train_iters=6", "trainer.save_interval=3", "trainer.eval_interval=3")


def test_eval_equals_the_training_log_for_each_checkpoint(cls_run, capsys):
    code, out, err = cli(["eval", str(cls_run)], capsys)
    assert code == 0, err
    written = json.loads((cls_run / "eval" / "step_00000006.json").read_text())
    assert written["step"] == 6 and written["checkpoint"].endswith("step_00000006")
    assert_same_metrics(written["metrics"], {**logged(cls_run, 6), **logged(cls_run, 6, "test/")})
    accuracy = written["metrics"]["validation/accuracy"]
    assert f"validation/accuracy  {accuracy:.4f}" in out

    early = cls_run / "checkpoints" / "step_00000003"
    code, out, err = cli(["eval", str(cls_run), "--checkpoint", str(early),
                          "--output", str(cls_run / "early.json")], capsys)
    assert code == 0, err
    metrics = json.loads((cls_run / "early.json").read_text())["metrics"]
    # training scores the test split only at its end; eval scores it for every checkpoint
    assert {"test/accuracy", "test/f1", "test/loss"} <= set(metrics)
    assert_same_metrics({k: v for k, v in metrics.items() if k.startswith("validation/")},
                        logged(cls_run, 3))


def test_eval_scores_other_data_named_by_overrides(cls_run, named_pairs, capsys):
    code, out, err = cli(["eval", str(cls_run), "data.validation_file=test.jsonl"], capsys)
    assert code == 0, err
    written = sorted((cls_run / "eval").glob("step_00000006-*.json"))
    assert len(written) == 1  # the run's own scores are not replaced
    record = json.loads(written[0].read_text())
    assert record["overrides"] == ["data.validation_file=test.jsonl"]
    test = {k.replace("test/", "validation/"): v for k, v in logged(cls_run, 6, "test/").items()}
    assert_same_metrics({k: v for k, v in record["metrics"].items()
                         if k.startswith("validation/")}, test)


def test_eval_overrides_are_checked_as_a_training_commands(cls_run, capsys):
    code, _, err = cli(["eval", str(cls_run), "data.validaton_file=x", "memory=zero2",
                        "trainer.resume=auto"], capsys)
    assert code == 2
    assert "did you mean 'data.validation_file'" in err
    assert "memory=zero2: eval reads the run's resolved config" in err
    assert "trainer.resume=auto: eval sets trainer.resume itself" in err
    code, _, err = cli(["eval", str(cls_run), "trainer.micro_batch_size=0"], capsys)
    assert code == 2 and "trainer.micro_batch_size" in one_error(err)


def test_eval_best_reads_the_runs_best_marker(cls_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(cls_run, run)
    code, _, err = cli(["eval", str(run), "--checkpoint", "best"], capsys)
    assert code == 2 and "best.json does not exist" in one_error(err)
    (run / "checkpoints" / "best.json").write_text(json.dumps(
        {"metric": "validation/accuracy", "mode": "max", "step": 3, "value": 0.5}))
    code, out, err = cli(["eval", str(run), "--checkpoint", "best"], capsys)
    assert code == 0, err
    assert "step_00000003 (step 3)" in out
    metrics = json.loads((run / "eval" / "step_00000003.json").read_text())["metrics"]
    assert_same_metrics({k: v for k, v in metrics.items() if k.startswith("validation/")},
                        logged(cls_run, 3))


def test_predict_writes_one_labelled_row_per_input_row(cls_run, named_pairs, tmp_path, capsys):
    rows = read_jsonl(named_pairs / "test.jsonl")[:10]
    given = tmp_path / "in.jsonl"
    given.write_text("".join(json.dumps({"id": i, "sentence1": r["sentence1"],
                                         "sentence2": r["sentence2"]}) + "\n"
                             for i, r in enumerate(rows)))
    code, out, err = cli(["predict", str(cls_run), "--input", str(given),
                          "--output", str(tmp_path / "out.jsonl"), "--batch-size", "4"], capsys)
    assert code == 0, err
    assert "wrote 10 predictions" in out
    predicted = read_jsonl(tmp_path / "out.jsonl")
    assert [p["id"] for p in predicted] == list(range(10))
    assert {p["prediction"] for p in predicted} <= {"different", "same"}
    assert all(0.5 <= p["score"] <= 1.0 for p in predicted)

    # the same rows as csv, through the exported model: the same labels and scores
    table = tmp_path / "in.csv"
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, ["id", "sentence1", "sentence2"])
        writer.writeheader()
        writer.writerows(read_jsonl(given))
    code, _, err = cli(["predict", str(cls_run), "--input", str(table), "--output",
                        str(tmp_path / "out.csv"), "--checkpoint", str(cls_run / "hf_model")],
                       capsys)
    assert code == 0, err
    with open(tmp_path / "out.csv", newline="") as f:
        exported = list(csv.DictReader(f))
    assert [r["prediction"] for r in exported] == [p["prediction"] for p in predicted]
    assert [float(r["score"]) for r in exported] == pytest.approx([p["score"] for p in predicted])

    # a run without an export: the label names come from its training data
    bare = tmp_path / "bare"
    shutil.copytree(cls_run, bare)
    shutil.rmtree(bare / "hf_model")
    code, _, err = cli(["predict", str(bare), "--input", str(given),
                        "--output", str(tmp_path / "bare.jsonl")], capsys)
    assert code == 0, err
    bare_rows = read_jsonl(tmp_path / "bare.jsonl")
    assert [p["prediction"] for p in bare_rows] == [p["prediction"] for p in predicted]
    assert [p["score"] for p in bare_rows] == pytest.approx([p["score"] for p in predicted])


def test_predict_refuses_bad_input_with_one_message(cls_run, tmp_path, capsys):
    def refused(name: str, text: str, *extra: str) -> str:
        given = tmp_path / name
        given.write_text(text)
        code, _, err = cli(["predict", str(cls_run), "--input", str(given), "--output",
                            str(tmp_path / f"out{given.suffix}"), *extra], capsys)
        assert code == 2, err
        assert not (tmp_path / f"out{given.suffix}").exists()
        return one_error(err)

    message = refused("missing.jsonl", '{"sentence1": "a b"}\n')
    assert "missing.jsonl" in message and "no column 'sentence2' (data.text_b_column)" in message
    assert "sentence1 (data.text_a_column), sentence2 (data.text_b_column)" in message
    message = refused("broken.jsonl", '{"sentence1": "a", "sentence2": "b"}\n{"sentence1": \n')
    assert "broken.jsonl:2 is not JSON" in message
    message = refused("columns.csv", "first,second\nx,y\n")
    assert "columns.csv: no column 'sentence1'" in message and "has: first, second" in message
    message = refused("other.jsonl", '{"sentence1": "a", "sentence2": "b"}\n', "--output",
                      str(tmp_path / "out.csv"))
    assert "written in the input's format (jsonl)" in message


def test_a_damaged_checkpoint_is_refused(cls_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(cls_run, run)
    weights = run / "checkpoints" / "step_00000006" / "model.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    given = tmp_path / "in.jsonl"
    given.write_text('{"sentence1": "a", "sentence2": "b"}\n')
    predict = ["predict", str(run), "--input", str(given), "--output", str(tmp_path / "o.jsonl")]
    for argv in (["eval", str(run)], predict):
        code, _, err = cli(argv, capsys)
        assert code == 2
        message = one_error(err)
        assert "step_00000006 is damaged: model.pt" in message and "--checkpoint PATH" in message
    code, _, err = cli(["eval", str(run), "--checkpoint",
                        str(run / "checkpoints" / "step_00000003")], capsys)
    assert code == 0, err


@pytest.mark.parametrize("verb", ["eval", "export"])
def test_a_checkpoint_pruned_while_it_is_read_is_taken_again_or_named(verb, cls_run, tmp_path,
                                                                       capsys, monkeypatch):
    """A run still training prunes (trainer.keep_last) the checkpoint a verb is verifying: the
    verb takes the newest again; a checkpoint named by the user is said to be removed (it read
    as damaged, "a file is missing")."""
    from rapidformer.checkpoint import store

    run = tmp_path / "run"
    shutil.copytree(cls_run, run)
    root = run / "checkpoints"
    verify = store.verify

    def a_save_and_a_prune_meanwhile(path, *args, **kwargs):
        if path.name == "step_00000006" and path.is_dir():
            if not (root / "step_00000009").exists():
                shutil.copytree(path, root / "step_00000009")  # the next save
            path.rename(root / ".tmp-pruned-step_00000006")
            shutil.rmtree(root / ".tmp-pruned-step_00000006")
        return verify(path, *args, **kwargs)

    monkeypatch.setattr(store, "verify", a_save_and_a_prune_meanwhile)
    out = ["--to", str(tmp_path / "exported")] if verb == "export" else []
    code, _, err = cli([verb, str(run), *out], capsys)
    assert code == 0, err
    assert verb == "export" or (run / "eval" / "step_00000009.json").is_file()
    shutil.copytree(root / "step_00000003", root / "step_00000006")
    named = (["--checkpoint", str(root / "step_00000006")] if verb == "eval"
             else ["--to", str(tmp_path / "again")])
    code, _, err = cli([verb, str(root / "step_00000006" if verb == "export" else run), *named],
                       capsys)
    assert code == 2 and "step_00000006 was removed while it was read" in one_error(err)
    assert "is damaged" not in err and not (tmp_path / "again").exists()


def test_a_failure_while_a_checkpoint_is_read_names_its_removal_only_when_it_is_gone(tmp_path):
    from rapidformer.checkpoint import reading
    from rapidformer.errors import InputError

    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    with pytest.raises(FileNotFoundError):  # still there: the library's own error stands
        with reading.named_if_pruned(ckpt, "rapidformer eval"):
            raise FileNotFoundError(ckpt / "model.pt")
    with pytest.raises(InputError, match="rapidformer eval: checkpoint .*step_00000004 was "
                                         "removed while it was read"):
        with reading.named_if_pruned(ckpt, "rapidformer eval"):
            ckpt.rename(tmp_path / ".tmp-pruned-step_00000004")
            raise FileNotFoundError(ckpt / "model.pt")


def test_predict_says_which_tasks_it_does_not_cover(cls_run, tmp_path, capsys):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    run = tmp_path / "run"
    run.mkdir()
    config, _ = settle(compose(["+recipe=gpt_pretrain", "data.path=corpus",
                                 "model.tokenizer=vocab.json", "model.merge_file=merges.txt"]),
                        str(run))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    given = tmp_path / "in.jsonl"
    given.write_text('{"text": "a"}\n')
    code, _, err = cli(["predict", str(run), "--input", str(given), "--output",
                        str(tmp_path / "o.jsonl")], capsys)
    assert code == 2  # the wrong verb for the run: bad input (it said "a later version")
    assert "task=causal_lm run" in one_error(err) and "use rapidformer generate" in one_error(err)
    code, _, err = cli(["eval", str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "no such run directory" in one_error(err)


# --- token classification -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ner_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("ner") / "run", "+recipe=bert_ner", "data=synthetic",
                 "data.synthetic_train_size=32", "data.synthetic_eval_size=16",
                 "data.max_seq_length=24", "trainer.train_iters=2", "trainer.export_hf=false",
                 "trainer.epochs=null")


def test_token_classification_eval_and_a_tag_per_word(ner_run, tmp_path, capsys):
    code, _, err = cli(["eval", str(ner_run)], capsys)
    assert code == 0, err
    assert_same_metrics(json.loads((ner_run / "eval" / "step_00000002.json").read_text())[
        "metrics"], logged(ner_run, 2))

    sentences = [r["tokens"] for r in read_jsonl(ner_run / "data" / "validation.jsonl")[:3]]
    long = [w for s in sentences for w in s] * 2  # past data.max_seq_length=24 tokens
    given = tmp_path / "words.jsonl"
    given.write_text("".join(json.dumps({"tokens": words}) + "\n" for words in sentences) +
                     json.dumps({"tokens": " ".join(long)}) + "\n")
    code, _, err = cli(["predict", str(ner_run), "--input", str(given),
                        "--output", str(tmp_path / "tags.jsonl")], capsys)
    assert code == 0, err
    predicted = read_jsonl(tmp_path / "tags.jsonl")
    names = {t for r in read_jsonl(ner_run / "data" / "train.jsonl") for t in r["ner_tags"]}
    assert [len(p["predicted_tags"]) for p in predicted] == [len(s) for s in sentences] + \
        [len(long)]
    assert all(t in names for p in predicted for t in p["predicted_tags"])


# --- question answering ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qa_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("qa") / "run", "+recipe=bert_squad", "data=synthetic",
                 "data.synthetic_train_size=32", "data.synthetic_eval_size=16",
                 "data.max_seq_length=48", "task.doc_stride=16", "trainer.train_iters=2",
                 "trainer.epochs=null")


def test_question_answering_eval_and_answer_spans(qa_run, tmp_path, capsys):
    code, _, err = cli(["eval", str(qa_run)], capsys)
    assert code == 0, err
    metrics = json.loads((qa_run / "eval" / "step_00000002.json").read_text())["metrics"]
    assert {"validation/exact_match", "validation/f1"} <= set(metrics)
    assert_same_metrics(metrics, logged(qa_run, 2))

    examples = read_jsonl(qa_run / "data" / "validation.jsonl")[:6]
    given = tmp_path / "questions.csv"
    with open(given, "w", newline="") as f:
        writer = csv.DictWriter(f, ["question", "context"])
        writer.writeheader()
        writer.writerows({"question": e["question"], "context": e["context"]} for e in examples)
    code, _, err = cli(["predict", str(qa_run), "--input", str(given),
                        "--output", str(tmp_path / "answers.csv")], capsys)
    assert code == 0, err
    with open(tmp_path / "answers.csv", newline="") as f:
        answers = list(csv.DictReader(f))
    assert len(answers) == len(examples) and any(row["answer"] for row in answers)
    for row, example in zip(answers, examples):
        assert row["context"] == example["context"]
        if row["answer"]:  # a span of the context, at the characters given
            start, end = int(row["answer_start"]), int(row["answer_end"])
            assert example["context"][start:end] == row["answer"]


def test_eval_keeps_integer_metrics_integers():
    import torch

    from rapidformer.cli.verbs.evaluate import plain_number
    from rapidformer.observability.format import format_value as shown

    assert [type(plain_number(v)) for v in (400, torch.tensor(7), True, 0.5, torch.tensor(0.25))] \
        == [int, int, int, float, float]
    assert (shown(plain_number(torch.tensor(400))), shown(plain_number(0.5))) == ("400", "0.5000")
