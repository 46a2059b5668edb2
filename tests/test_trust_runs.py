"""A run or verb never ends "ok" having done something other than asked, and a refusal changes
nothing on disk: a stop as asked is reported as a stop, a resume after a change trains what is
asked in the new terms, a verb refuses a run it does not serve, and a run refused before it
trained leaves its directory byte for byte as it was (tables of cases, in-process CLI)."""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import pytest
import yaml

from tests.conftest import FAST, read_metrics
from tests.test_bad_input import call

TINY = ["trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.log_interval=1",
        "model.hidden_size=16", "model.num_layers=1", "model.num_attention_heads=2",
        "model.intermediate_size=32", "model.vocab_size=120", "trainer.export_hf=false"]


def steps_trained(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


# --- a stop as asked is a stop ------------------------------------------------------------------

@pytest.mark.parametrize("length", [["trainer.train_iters=12", "trainer.epochs=null"],
                                    ["trainer.epochs=3"]])
def test_exit_interval_is_reported_as_a_stop_and_its_resume_line_goes_on(length, tmp_path,
                                                                          capsys):
    run = tmp_path / "run"
    code, err = call("rapidformer", [*TINY, *length, "data.synthetic_train_size=128",
                                     "trainer.micro_batch_size=16", "trainer.global_batch_size=32",
                                     "trainer.exit_interval=5", f"trainer.output_dir={run}"],
                     capsys)
    assert code == 0, err[-2000:]
    total = 12
    assert f"rapidformer: run stopped at step 5 of {total} (trainer.exit_interval=5)" in err
    assert "run finished" not in err
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "stopped", "error": f"trainer.exit_interval=5 at step 5 of {total}"}
    resume = next(line.split("resume", 1)[1].strip() for line in err.splitlines()
                  if line.strip().startswith("resume "))
    assert "trainer.exit_interval" not in resume
    argv = shlex.split(resume)[3:]  # python -m rapidformer ...
    code, err = call("rapidformer", argv, capsys)
    assert code == 0, err[-2000:]
    assert "rapidformer: run finished" in err
    assert steps_trained(run) == list(range(1, total + 1))
    assert json.loads((run / "status.json").read_text())["status"] == "ok"


# --- a resume trains what is asked, in the new terms --------------------------------------------

@pytest.mark.parametrize("change,steps_after", [
    # the case: 96 rows, 2 epochs of 3 steps (micro 16 / global 32), stopped at step 2;
    # with global 64 an epoch is 1 step: epoch 0 is complete (64 samples taken), epoch 1 is left
    (["trainer.global_batch_size=64"], [3]),
    # a smaller training file: 64 rows, 2 steps an epoch of 32; epoch 0 is over, epoch 1 left
    (["data.synthetic_train_size=64", "data.path=DATA64"], [3, 4]),
    # nothing changed: the rest of the two epochs
    ([], [3, 4, 5, 6]),
])
def test_an_epoch_resume_after_a_change_trains_every_epoch_asked(change, steps_after, tmp_path,
                                                                 capsys):
    run = tmp_path / "run"
    first = [*TINY, "trainer.epochs=2", "data.synthetic_train_size=96",
             f"data.path={tmp_path}/data96", "trainer.micro_batch_size=16",
             "trainer.global_batch_size=32", f"trainer.output_dir={run}"]
    code, err = call("rapidformer", [*first, "trainer.exit_interval=2"], capsys)
    assert code == 0 and steps_trained(run) == [1, 2], err[-2000:]
    again = [a.replace("DATA64", f"{tmp_path}/data64") for a in change]
    code, err = call("rapidformer", [*first, *again, "trainer.resume=auto"], capsys)
    assert code == 0, err[-2000:]
    assert steps_trained(run) == [1, 2, *steps_after]
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records[-1]["epoch"] == 1  # the last step is in the second epoch


# --- a verb refuses a run it does not serve -----------------------------------------------------

TASK_RUNS = {
    "sequence_classification": [],
    "token_classification": ["+recipe=bert_ner", "data=synthetic"],
    "question_answering": ["+recipe=bert_squad", "data=synthetic"],
    "masked_lm": ["+recipe=bert_mlm", "data=synthetic"],
    "seq2seq_lm": ["+recipe=t5_summarize", "model=t5_tiny", "data=synthetic"],
    "sft": ["+recipe=llama_sft"],
    "causal_lm": ["+recipe=gpt_pretrain", "data.path=corpus", "model.tokenizer=vocab.json",
                  "model.merge_file=merges.txt"],
    "bert_pretraining": ["+recipe=bert_pretrain", "data.path=corpus", "model.tokenizer=vocab.txt"],
}
SERVED = {"eval": {"sequence_classification", "token_classification", "question_answering",
                   "masked_lm", "seq2seq_lm", "sft"},
          "predict": {"sequence_classification", "token_classification",
                      "question_answering", "masked_lm", "seq2seq_lm"},
          "generate": {"sft", "causal_lm"}}


@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_each_verb_refuses_a_run_it_does_not_serve_naming_the_ones_that_do(task, tmp_path,
                                                                            capsys):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    run = tmp_path / "run"
    run.mkdir()
    plain, _ = settle(compose(TASK_RUNS[task]), str(run))
    assert plain["task"]["name"] == task
    (run / "config.yaml").write_text(yaml.safe_dump(plain))
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"text": "a"}\n')
    argv = {"eval": ["eval", str(run)],
            "predict": ["predict", str(run), "--input", str(rows), "--output",
                        str(tmp_path / "out.jsonl")],
            "generate": ["generate", str(run), "--prompt", "hi"]}
    for verb, served in SERVED.items():
        code, err = call("cli", argv[verb], capsys)
        refused = f"rapidformer {verb} serves runs of task=" in err
        assert refused == (task not in served), (verb, err[-1500:])
        if refused:
            others = [v for v, tasks in SERVED.items() if task in tasks]
            assert code == 2 and f"is a task={task} run" in err
            assert all(f"rapidformer {v}" in err for v in others), err


# --- a refusal changes nothing on disk ----------------------------------------------------------

def tree(path: Path) -> dict:
    """Every file under `path`: its bytes' digest (the lock's holder record aside)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    import shutil

    run = tmp_path_factory.mktemp("finished") / "run"
    code = call_quiet([*TINY, "trainer.train_iters=3", "trainer.epochs=null",
                       "data.synthetic_train_size=64", f"trainer.output_dir={run}"])
    assert code == 0
    return run, shutil.copytree


def call_quiet(argv: list[str]) -> int:
    from rapidformer import __main__ as module_main

    try:
        module_main.main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


@pytest.mark.parametrize("overrides,message", [
    (["model.hidden_size=32"], "holds a model of"),  # refused once the model is built
    (["trainer.train_iters=2"], "past what this run asks"),
    (["peft=lora"], "holds a whole model (trained with peft=none)"),
    (["memory=zero2"], "was written with memory=none"),
    (["data.synthetic_train_size=64", "data.max_seq_length=4"], "must be at least 8"),
])
def test_a_refused_resume_leaves_every_byte_as_it_was(finished_run, overrides, message,
                                                      tmp_path, capsys):
    source, copy = finished_run
    run = tmp_path / "run"
    copy(source, run, symlinks=True)
    before = tree(run)
    code, err = call("rapidformer", [*TINY, "trainer.train_iters=3", "trainer.epochs=null",
                                     "data.synthetic_train_size=64", f"trainer.output_dir={run}",
                                     "trainer.resume=auto", *overrides], capsys)
    assert code == 2 and message in err, err[-2000:]
    assert tree(run) == before
    from rapidformer.cli.verbs.export import export  # the run's files still agree

    export(run, tmp_path / "exported")


def test_a_refused_overwrite_puts_the_earlier_run_back(finished_run, tmp_path, capsys):
    source, copy = finished_run
    run = tmp_path / "run"
    copy(source, run, symlinks=True)
    before = tree(run)
    bad = tmp_path / "bad"  # a data folder the run refuses once it reads it, after the claim
    bad.mkdir()
    (bad / "train.jsonl").write_text('{"sentence1": "a", "sentence2": "b"}\n')
    code, err = call("rapidformer", [*TINY, "trainer.train_iters=3", "trainer.epochs=null",
                                     "data=pairs_local", f"data.path={bad}",
                                     f"trainer.output_dir={run}", "trainer.overwrite=true"],
                     capsys)
    assert code == 2, err[-2000:]
    assert tree(run) == before


# --- paths the override syntax reads itself ------------------------------------------------------

@pytest.mark.parametrize("name", ["données", "a,b", "x=y", "(x)", "[x]", "{x}", "it's",
                                  "a b,c", "日本"])
def test_a_path_with_characters_of_the_override_syntax_says_how_to_quote_it(name, tmp_path,
                                                                             capsys):
    """Written bare, one message that says how to quote it; quoted as it says, the run goes
    on; and the commands the run prints run as printed from that directory."""
    from rapidformer.config.compose import check_overrides, override

    run = tmp_path / name / "run"
    bare = f"trainer.output_dir={run}"
    code, err = call("rapidformer", [*TINY, "trainer.train_iters=1", "trainer.epochs=null",
                                     "data.synthetic_train_size=64", bare], capsys)
    special = any(c in ",=()[]{}'" or not c.isascii() for c in name)
    if special:
        assert code == 2 and "quote" in err and "Traceback" not in err, err[-1500:]
        quoted = shlex.split(err.split(" e.g. ", 1)[1].split(" in a shell")[0])[0]
        assert quoted == override("trainer.output_dir", run)
    else:
        quoted = bare
    check_overrides([quoted])
    code, err = call("rapidformer", [*TINY, "trainer.train_iters=1", "trainer.epochs=null",
                                     "data.synthetic_train_size=64", quoted], capsys)
    assert code == 0, err[-2000:]
    resume = next(line.split("resume", 1)[1].strip() for line in err.splitlines()
                  if line.strip().startswith("resume "))
    code, err = call("rapidformer", [*shlex.split(resume)[3:], "trainer.train_iters=2"], capsys)
    assert code == 0 and steps_trained(run) == [1, 2], err[-2000:]


# --- a damaged index: one message, nothing after it ----------------------------------------------

DAMAGE = {"empty": lambda b: b"", "header only": lambda b: b[:9], "counts cut": lambda b: b[:20],
          "no lengths": lambda b: b[:34], "half": lambda b: b[:len(b) // 2],
          "one byte short": lambda b: b[:-1], "eight bytes more": lambda b: b + b"\0" * 8}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_cut_or_grown_index_is_named_before_megatron_core_opens_it(damage, tmp_path,
                                                                    pretraining_data,
                                                                    monkeypatch):
    """Before megatron-core reads it: a half-made IndexedDataset fails again when it is collected
    and prints a traceback after rapidformer's message."""
    import shutil

    from megatron.core.datasets import indexed_dataset

    from rapidformer.data.megatron import open_indexed
    from rapidformer.errors import InputError

    source = Path(pretraining_data["gpt"])
    prefix = tmp_path / "cut"
    shutil.copy(f"{source}.bin", f"{prefix}.bin")
    Path(f"{prefix}.idx").write_bytes(DAMAGE[damage](Path(f"{source}.idx").read_bytes()))
    monkeypatch.setattr(indexed_dataset.IndexedDataset, "__init__",
                        lambda *a, **k: pytest.fail("megatron-core opened a damaged index"))
    with pytest.raises(InputError) as info:
        open_indexed(str(prefix))
    text = str(info.value)
    assert f"{prefix}.idx" in text
    assert "regenerate it" in text or "is not a Megatron mmap index" in text
