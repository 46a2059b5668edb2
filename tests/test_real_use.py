"""Fine-tuning one's own saved Hugging Face models on data in real layouts: a trained head's
label order, a head of another size, a decoder without a padding token, sequences beyond the
learned positions, rows without their text, GLUE's unlabelled test.tsv, SQuAD's answer layouts
and offsets, NER sentences longer than the sequence, the losses of a run stopped between log
steps, and the verbs through `python -m rapidformer`."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from rapidformer.config.schema import DataConfig, ModelConfig
from rapidformer.errors import ConfigError, InputError
from rapidformer.models.head_labels import head_labels
from tests.conftest import FAST, read_metrics, run_here

WORDS = "the movie film story acting plot was good great bad terrible anna ben paris".split()


def _wordpiece():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=int(1e30))


def _saved_bert(path, head: str | None, labels=None, positions: int = 128):
    """A local BERT (with a classifier head of `labels`, `head`: "sequence"/"token"/None)."""
    import transformers

    tokenizer = _wordpiece()
    extra = {} if labels is None else {"id2label": dict(enumerate(labels)),
                                       "label2id": {n: i for i, n in enumerate(labels)}}
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=positions,
                                     **extra)
    cls = {"sequence": transformers.BertForSequenceClassification,
           "token": transformers.BertForTokenClassification}.get(head, transformers.BertForMaskedLM)
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _model(path) -> ModelConfig:
    """model=hf model.name_or_path=PATH: the model's own shape (the group's keys unset)."""
    from rapidformer.models.pretrained_shape import CONFIG_NAMES

    return ModelConfig(name="hf", source="pretrained", name_or_path=str(path),
                       **{key: None for key in CONFIG_NAMES})


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


SENTIMENT = [{"text": f"the movie was {w}", "label": "positive" if w in ("good", "great")
              else "negative"} for w in ("good", "bad", "great", "terrible") * 4]


# --- a pretrained head's label order --------------------------------------------------------------
@pytest.mark.parametrize("trained,expected", [
    (["positive", "negative"], ["positive", "negative"]),  # the head's order, not sorted
    (["negative", "positive"], ["negative", "positive"]),
    (["negative", "neutral", "positive"], ["negative", "neutral", "positive"]),  # a subset: 3
    (["LABEL_0", "LABEL_1"], ["negative", "positive"]),  # placeholders mean nothing: sorted
    (["pos", "neg"], ["negative", "positive"]),  # other names: the data's own order
    (None, ["negative", "positive"]),  # a base model without a head
])
def test_a_pretrained_heads_label_order_numbers_the_data(tmp_path, trained, expected, caplog):
    from rapidformer.data.text_classification import load_classification_data

    model = _saved_bert(tmp_path / "model", "sequence" if trained else None, trained)
    _jsonl(tmp_path / "data" / "train.jsonl", SENTIMENT)
    _jsonl(tmp_path / "data" / "validation.jsonl", SENTIMENT[:4])
    d = DataConfig(source="local", path=str(tmp_path / "data"), text_a_column="text",
                   text_b_column=None, label_column="label")
    with caplog.at_level(logging.WARNING, logger="rapidformer"):
        data = load_classification_data(d, tmp_path, None, head_labels(_model(model)))
    assert data.label_names == expected and data.num_labels == len(expected)
    validation = data.splits["validation"]["label"]
    assert [expected[i] for i in validation] == [r["label"] for r in SENTIMENT[:4]]
    assert ("are not among them" in caplog.text) == (trained == ["pos", "neg"])


def test_a_pretrained_token_heads_tag_order_numbers_the_data(tmp_path):
    from rapidformer.data.token_labels import load_token_data

    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    model = _saved_bert(tmp_path / "model", "token", tags)
    rows = [{"tokens": ["anna", "ben", "paris"], "ner_tags": ["B-PER", "I-PER", "B-LOC"]},
            {"tokens": ["the", "movie", "paris"], "ner_tags": ["O", "O", "B-LOC"]}]
    _jsonl(tmp_path / "data" / "train.jsonl", rows * 4)
    d = DataConfig(source="local", path=str(tmp_path / "data"))
    data = load_token_data(d, tmp_path, None, head=head_labels(_model(model)))
    assert data.names == tags  # sorted, it would be O, B-LOC, B-PER, I-LOC, I-PER
    assert data.splits["train"]["ner_tags"][0] == [1, 2, 3]


def test_a_head_of_another_size_starts_anew_and_the_body_loads(tmp_path, caplog):
    import transformers

    from rapidformer.models.hf import build_sequence_classifier

    path = _saved_bert(tmp_path / "nli", "sequence", ["entailment", "neutral", "contradiction"])
    with caplog.at_level(logging.WARNING, logger="rapidformer"):
        model = build_sequence_classifier(_model(path), 2, None, ["negative", "positive"])
    assert model.classifier.out_features == 2
    assert "has a head of 3 classes and this run's data 2" in caplog.text
    trained = transformers.BertForSequenceClassification.from_pretrained(path)
    assert torch.equal(model.bert.embeddings.word_embeddings.weight,
                       trained.bert.embeddings.word_embeddings.weight)


# --- a decoder without a padding token classifies -----------------------------------------------
def test_a_gpt2_without_a_padding_token_fine_tunes_a_classifier(tmp_path, capsys, monkeypatch):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    assert tokenizer.pad_token is None  # as GPT-2's and Llama's tokenizers ship
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    _jsonl(tmp_path / "data" / "train.jsonl", SENTIMENT)
    _jsonl(tmp_path / "data" / "validation.jsonl", SENTIMENT[:4])
    run = tmp_path / "run"
    code, printed = run_here([
        "+recipe=bert_mrpc", "model=hf", f"model.name_or_path={tmp_path / 'gpt2'}",
        "data=pairs_local", f"data.path={tmp_path / 'data'}", "data.text_a_column=text",
        "data.text_b_column=null", "data.max_seq_length=32", "trainer.epochs=1",
        "trainer.micro_batch_size=4", "trainer.global_batch_size=4", f"trainer.output_dir={run}",
        "trainer.progress_bar=false"], capsys, monkeypatch, tmp_path)
    assert code == 0, printed[-3000:]
    exported = json.loads((run / "hf_model" / "config.json").read_text())
    assert exported["pad_token_id"] == tokenizer.eos_token_id
    assert any("validation/accuracy" in r for r in read_metrics(run))


def test_a_tokenizer_with_nothing_to_pad_with_is_refused():
    from types import SimpleNamespace

    from rapidformer.data.tokenizers import ready_to_pad

    with pytest.raises(InputError, match="no padding token and no end-of-sequence token"):
        ready_to_pad(SimpleNamespace(pad_token=None, eos_token=None, sep_token=None))


# --- the learned positions ------------------------------------------------------------------------
@pytest.mark.parametrize("model_type,positions,length,problem", [
    ("bert", 64, 64, None),
    ("bert", 64, 128, "longer than the 64 positions"),
    ("roberta", 514, 512, None),  # RoBERTa's table starts after its padding id
    ("roberta", 514, 513, "longer than the 512 positions"),
    ("gpt2", 1024, 2048, "longer than the 1024 positions"),
    ("llama", 2048, 8192, None),  # rotary: no table
    ("t5", 512, 2048, None),  # relative
])
def test_sequences_beyond_a_pretrained_models_positions_are_refused(model_type, positions,
                                                                   length, problem):
    import transformers

    from rapidformer.models.pretrained_shape import position_problem

    config = transformers.AutoConfig.for_model(model_type)
    for name in ("max_position_embeddings", "n_positions"):
        if hasattr(config, name):
            setattr(config, name, positions)
    got = position_problem(_model("m"), config, length)
    assert got is None if problem is None else problem in got, got


def test_the_position_check_runs_before_the_run_on_a_saved_model(tmp_path):
    from rapidformer.models.pretrained_shape import check_local_shape

    path = _saved_bert(tmp_path / "model", "sequence", positions=64)
    check_local_shape(_model(path), 64)
    with pytest.raises(ConfigError, match="data.max_seq_length=128 is longer than the 64"):
        check_local_shape(_model(path), 128)


# --- rows without their text; GLUE's test.tsv -----------------------------------------------------
@pytest.mark.parametrize("fmt,bad_row,line", [
    ("jsonl", {"review": "the plot", "label": "negative"}, 3),  # the text under another key
    ("jsonl", {"text": None, "label": "negative"}, 3),
    ("csv", {"text": "", "label": "negative"}, 4),  # an empty cell (after the header)
])
def test_a_row_without_its_text_is_refused_with_its_line(tmp_path, fmt, bad_row, line):
    import pandas as pd

    from rapidformer.data.text_classification import load_classification_data

    rows = [*SENTIMENT[:2], bad_row, *SENTIMENT[2:]]
    if fmt == "csv":
        pd.DataFrame(rows).to_csv(tmp_path / "train.csv", index=False)
    else:
        _jsonl(tmp_path / "train.jsonl", rows)
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="text", text_b_column=None,
                   label_column="label")
    with pytest.raises(InputError, match=rf"line {line} has no text in column 'text' "
                                         rf"\(data.text_a_column\)"):
        load_classification_data(d, tmp_path, None)
    _jsonl(tmp_path / "train.jsonl", [*SENTIMENT[:2], {"text": "", "label": "negative"}])
    (tmp_path / "train.csv").unlink(missing_ok=True)
    load_classification_data(d, tmp_path, None)  # an explicit "" in JSON is a text


def test_glues_test_tsv_without_its_label_column_loads_unscored(tmp_path):
    from rapidformer.data.text_classification import load_classification_data
    from rapidformer.run_inputs import column_problems
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    rows = "".join(f"{i % 2}\t{i}\t{i + 100}\tthe movie {i}\tthe film {i}\n" for i in range(8))
    (tmp_path / "train.tsv").write_text(header + rows)
    (tmp_path / "dev.tsv").write_text(header + rows)
    (tmp_path / "test.tsv").write_text("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "".join(
        f"{i}\t{i}\t{i + 100}\tthe movie {i}\tthe film {i}\n" for i in range(3)))
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="#1 String",
                   text_b_column="#2 String", label_column="Quality")
    data = load_classification_data(d, tmp_path, None)
    assert data.scored_splits == ("validation",)
    assert data.splits["test"]["label"] == [-1, -1, -1]
    _, cfg = settle(compose(["+recipe=bert_mrpc", "model=bert_tiny", "data=pairs_local",
                            f"data.path={tmp_path}", "data.text_a_column='#1 String'",
                            "data.text_b_column='#2 String'", "data.label_column=Quality"]))
    files = {s: tmp_path / f for s, f in (("train", "train.tsv"), ("validation", "dev.tsv"),
                                          ("test", "test.tsv"))}
    assert column_problems(cfg, files) == []


# --- SQuAD's layouts ------------------------------------------------------------------------------
CONTEXT = "ben works for acme 😀 . anna lives in 東京 ."
AT = CONTEXT.index("東京")
GOOD = {"text": ["東京"], "answer_start": [AT]}


@pytest.mark.parametrize("row,message", [
    ({"answers": GOOD}, None),
    ({"answers": [{"text": "東京", "answer_start": AT}]}, None),  # SQuAD's own files' layout
    ({"answers": {"text": [], "answer_start": []}}, "unanswerable questions (SQuAD v2) are not "
                                                    "supported yet"),
    ({"answers": {"text": ["東京"], "answer_start": [len(CONTEXT[:AT].encode())]}},
     f"the text is at character {AT}: answer_start counts characters of the context from 0, "
     f"not bytes"),
    ({"answers": {"text": ["tokyo"], "answer_start": [3]}}, "the text is nowhere in the context"),
    ({"answers": {"text": ["東京"]}}, "that are not {\"text\": [...], \"answer_start\": [...]}"),
    ({"question": None, "answers": GOOD}, "has no question in column 'question'"),
    ({"context": "  ", "answers": GOOD}, "has no context in column 'context'"),
])
def test_question_answering_rows_are_checked_with_their_line(tmp_path, row, message):
    from rapidformer.data.local_files import read_file, remember
    from rapidformer.data.qa_rows import checked_splits

    base = {"id": "q", "question": "where does anna live ?", "context": CONTEXT}
    path = _jsonl(tmp_path / "train.jsonl", [{**base, "answers": GOOD}, {**base, **row}])
    ds = read_file(path, "jsonl")
    remember(ds, path)
    d = DataConfig(source="local", path=str(tmp_path))
    if message is None:
        out = checked_splits({"train": ds}, d)["train"]
        assert out["answers"][1] == GOOD
        return
    with pytest.raises(InputError) as caught:
        checked_splits({"train": ds}, d)
    assert f"{path} line 2" in str(caught.value) and message in str(caught.value)


def test_squads_nested_file_is_named_as_such(tmp_path):
    from types import SimpleNamespace

    from rapidformer.data.text_classification import require_columns

    with pytest.raises(InputError, match="is SQuAD's nested file"):
        require_columns({"train": SimpleNamespace(column_names=["version", "data"])},
                        {"data.question_column": "question"})


# --- NER sentences longer than the sequence -------------------------------------------------------
def test_entities_past_the_cut_count_as_missed():
    from rapidformer.data.token_labels import unseen_entities

    names = ["O", "B-PER", "I-PER"]
    tags = [1, 2, 0, 0, 1, 2, 0]  # entities at words 0-1 and 4-5
    # word ids of an encoding that kept words 0..4: the second entity is cut in two
    word_ids = [None, 0, 1, 2, 3, 4, None]
    labels = [-100, 1, 2, 0, 0, 1, -100]
    assert unseen_entities(word_ids, tags, labels, names) == 1
    assert labels == [-100, 1, 2, 0, 0, -100, -100]  # its kept half is not scored as a whole
    assert unseen_entities([None, 0, 1, 2, 3, 4, 5, 6, None], tags, list(labels), names) == 0


def test_ner_scores_count_the_entities_of_long_sentences(tmp_path, capsys, monkeypatch):
    short = {"tokens": ["anna", "ben", "the", "paris"],
             "ner_tags": ["B-PER", "I-PER", "O", "B-LOC"]}
    long = {"tokens": ["anna", "ben", *["the"] * 40, "paris"],
            "ner_tags": ["B-PER", "I-PER", *["O"] * 40, "B-LOC"]}
    _jsonl(tmp_path / "data" / "train.jsonl", [short] * 8)
    _jsonl(tmp_path / "data" / "validation.jsonl", [long] * 4)
    run = tmp_path / "run"
    code, printed = run_here([
        "+recipe=bert_ner", "model=bert_tiny", "data=local", f"data.path={tmp_path / 'data'}",
        "data.max_seq_length=16", "trainer.epochs=1", "trainer.micro_batch_size=4",
        "trainer.global_batch_size=4", "trainer.export_hf=false", f"trainer.output_dir={run}",
        "trainer.progress_bar=false"], capsys, monkeypatch, tmp_path)
    assert code == 0, printed[-3000:]
    assert "validation: 4 gold entities lie past data.max_seq_length=16" in printed
    recall = [r["validation/recall"] for r in read_metrics(run) if "validation/recall" in r]
    assert recall and max(recall) <= 0.5  # the 4 locations past the cut are never found


# --- the loss of a run stopped between log steps; verbs through python -m -----------------------
def test_a_stop_between_log_steps_logs_the_steps_before_it(tmp_path, capsys, monkeypatch):
    args = [*FAST, "trainer.epochs=null", "trainer.train_iters=14", "trainer.log_interval=10",
            "trainer.export_hf=false", "trainer.micro_batch_size=32"]
    for name, extra in (("whole", []), ("parts", ["trainer.exit_interval=5"]),
                        ("parts", ["trainer.resume=auto"])):
        code, printed = run_here([*args, *extra, f"trainer.output_dir={tmp_path / name}"],
                                 capsys, monkeypatch, tmp_path)
        assert code == 0, printed[-3000:]
    whole, parts = ([r for r in read_metrics(tmp_path / n) if "loss" in r]
                    for n in ("whole", "parts"))
    assert [r["step"] for r in whole] == [10, 14] and [r["step"] for r in parts] == [5, 10, 14]
    # the same steps, logged in other windows: steps 1-10's mean is the two windows' mean
    assert (parts[0]["loss"] + parts[1]["loss"]) / 2 == pytest.approx(whole[0]["loss"],
                                                                       rel=1e-5)
    assert parts[2]["loss"] == pytest.approx(whole[1]["loss"], rel=1e-5)


@pytest.mark.parametrize("verb", ["validate", "ls"])
def test_verbs_run_through_python_m_rapidformer(tmp_path, capsys, monkeypatch, verb):
    code, printed = run_here([verb], capsys, monkeypatch, tmp_path)
    assert code == 0, printed
    assert ("ok: recipe=quickstart" if verb == "validate" else "recipe:") in printed


# --- generated data and a trained vocabulary, complete or written again ---------------------------
def test_generated_data_is_written_again_when_cut_short_or_made_otherwise(tmp_path):
    from rapidformer.data.synthetic import write_dataset
    from rapidformer.data.text_classification import GENERATED, generate_once

    root = tmp_path / "data"
    generate_once(root, write_dataset, 32, 8, 1)
    made = (root / "train.jsonl").stat().st_mtime_ns
    generate_once(root, write_dataset, 32, 8, 1)  # the same settings, complete: kept
    assert (root / "train.jsonl").stat().st_mtime_ns == made
    (root / "validation.jsonl").unlink()  # a set cut short
    generate_once(root, write_dataset, 32, 8, 1)
    assert len((root / "validation.jsonl").read_text().splitlines()) == 8
    generate_once(root, write_dataset, 64, 8, 1)  # another size: what config.yaml says
    assert len((root / "train.jsonl").read_text().splitlines()) == 64
    (root / GENERATED).unlink()  # a kill before the record: the whole set again
    generate_once(root, write_dataset, 64, 8, 1)
    assert json.loads((root / GENERATED).read_text())["files"] == ["test.jsonl", "train.jsonl",
                                                                   "validation.jsonl"]


def test_a_half_written_vocabulary_is_trained_again(tmp_path):
    from rapidformer.data.tokenizers import build_tokenizer

    save = tmp_path / "tokenizer"
    save.mkdir()
    (save / "vocab.txt").write_text("")  # a stopped run's, before its config was written
    m = ModelConfig(name="bert_tiny", source="config", vocab_size=200)
    tokenizer = build_tokenizer(m, lambda: [" ".join(WORDS)] * 8, save, 32)
    assert (save / "tokenizer_config.json").is_file() and len(tokenizer) > 5
    assert not list(tmp_path.glob(".tmp-*"))
    assert build_tokenizer(m, lambda: [], save, 32).get_vocab() == tokenizer.get_vocab()


def test_an_output_dir_that_is_a_dangling_link_is_named_as_such(tmp_path, capsys, monkeypatch):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    code, printed = run_here([*FAST, f"trainer.output_dir={link}"], capsys, monkeypatch, tmp_path)
    assert code == 2, printed[-2000:]
    assert f"trainer.output_dir={link} is a symbolic link that leads nowhere" in printed
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_a_resume_whose_model_differs_with_no_model_setting_names_the_task():
    from types import SimpleNamespace

    from rapidformer.checkpoint.resume import model_change

    saved = SimpleNamespace(model=SimpleNamespace(num_parameters=10, settings={"name": "x"}))
    got = model_change(saved, ModelConfig(name="x"), 12)
    assert "no model setting changed: the task, whose head is part of the model" in got


def test_a_head_named_in_id2label_alone_numbers_the_data(tmp_path):
    """transformers saves label2id as null for a config given id2label alone."""
    from rapidformer.data.text_classification import load_classification_data

    model = _saved_bert(tmp_path / "model", "sequence", ["positive", "negative"])
    config = json.loads((model / "config.json").read_text())
    config["label2id"] = None
    (model / "config.json").write_text(json.dumps(config))
    _jsonl(tmp_path / "data" / "train.jsonl", SENTIMENT)
    d = DataConfig(source="local", path=str(tmp_path / "data"), text_a_column="text",
                   text_b_column=None, label_column="label")
    data = load_classification_data(d, tmp_path, None, head_labels(_model(model)))
    assert data.label_names == ["positive", "negative"]


def test_ids_that_a_classlabel_names_follow_the_heads_order(tmp_path):
    """A hub dataset's (or a parquet file written by `datasets`) ids with ClassLabel names: a
    head trained as {positive: 0, negative: 1} on data whose ClassLabel is [negative, positive]
    gets each row's id of its name (CoNLL-2003 from the hub with a NER model: the same)."""
    import datasets

    from rapidformer.data.text_classification import load_classification_data
    from rapidformer.data.token_labels import load_token_data

    model = _saved_bert(tmp_path / "model", "sequence", ["positive", "negative"])
    rows = {"text": [r["text"] for r in SENTIMENT],
            "label": [int(r["label"] == "positive") for r in SENTIMENT]}
    features = datasets.Features({"text": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    (tmp_path / "cls").mkdir()
    datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "cls" /
                                                                    "train.parquet")
    d = DataConfig(source="local", path=str(tmp_path / "cls"), text_a_column="text",
                   text_b_column=None, label_column="label")
    data = load_classification_data(d, tmp_path, None, head_labels(_model(model)))
    assert data.label_names == ["positive", "negative"]
    assert [data.label_names[i] for i in data.splits["train"]["label"]] == \
        [r["label"] for r in SENTIMENT]

    tags = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    ner = _saved_bert(tmp_path / "ner", "token", tags)
    given = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=given))})
    (tmp_path / "tok").mkdir()
    datasets.Dataset.from_dict({"tokens": [["anna", "ben", "paris"]] * 4,
                                "ner_tags": [[1, 2, 3]] * 4}, features=features
                               ).to_parquet(tmp_path / "tok" / "train.parquet")
    data = load_token_data(DataConfig(source="local", path=str(tmp_path / "tok")), tmp_path,
                           None, head=head_labels(_model(ner)))
    assert data.names == tags
    assert [data.names[i] for i in data.splits["train"]["ner_tags"][0]] == \
        ["B-PER", "I-PER", "B-LOC"]


def test_csv_texts_that_read_like_missing_values_are_texts(tmp_path):
    from rapidformer.data.text_classification import load_classification_data

    (tmp_path / "train.csv").write_text("text,label\nNone,negative\nNA,positive\nnull,negative\n"
                                        "nan,positive\n")
    d = DataConfig(source="local", path=str(tmp_path), text_a_column="text", text_b_column=None,
                   label_column="label")
    data = load_classification_data(d, tmp_path, None)
    assert data.splits["train"]["text"] == ["None", "NA", "null", "nan"]


def test_an_early_stop_between_log_steps_logs_the_steps_before_it(tmp_path, capsys,
                                                                   monkeypatch):
    run = tmp_path / "run"
    code, printed = run_here([
        *FAST, "trainer.epochs=null", "trainer.train_iters=40", "trainer.log_interval=10",
        "trainer.eval_interval=3", "trainer.best_metric=validation/loss",
        "trainer.early_stopping_patience=1", "trainer.early_stopping_min_delta=100",
        "trainer.export_hf=false", f"trainer.output_dir={run}"], capsys, monkeypatch, tmp_path)
    assert code == 0, printed[-3000:]
    losses = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert losses == [6], losses  # stopped at step 6, its steps logged there
