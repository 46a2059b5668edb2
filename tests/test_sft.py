"""Supervised fine-tuning (task=sft): chat rendering and the assistant-only labels on
hand-made examples, prompt/response rows, truncation and refusals, packing's loss equal to the
unpadded batch's, and the llama_sft recipe learning its generated answers in-process."""
from __future__ import annotations

import json
import pytest
import torch

from rapidformer.config.schema import DataConfig
from rapidformer.data.chat import (EncodeCounts, PackedCollate, encode_rows, generation_prompts,
                                   pack)
from rapidformer.data.counts import take_counts
from rapidformer.data.lengths import IGNORE
from rapidformer.errors import InputError
from tests.test_decoders import QUIET, pretrain, tiny_llama

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}{% if m['role'] == "
            "'assistant' %} {{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
WORDS = ["where", "does", "anna", "live", "paris", "who", "ben", "work", "for", "acme", "answer",
         "briefly", "user", "assistant", "system", "question"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from rapidformer.data.tokenizers import train_wordpiece
    from rapidformer.tasks.sft import ready_for_chat

    texts = [" ".join(WORDS), "< | > ? : ."]
    tok = train_wordpiece(texts, tmp_path_factory.mktemp("tok"), 200, True, 128)
    ready_for_chat(tok, TEMPLATE)
    return tok


def with_template(tokenizer, template):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def rows(examples: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(examples)


def labelled_text(tokenizer, ids, labels) -> list[str]:
    """The labelled runs of a row, decoded."""
    runs, run = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE:
            if run:
                runs.append(tokenizer.decode(run))
            run = []
        else:
            assert label == token
            run.append(token)
    if run:
        runs.append(tokenizer.decode(run))
    return runs


def encoded(tokenizer, examples, loss_on="response", max_seq_length=128, **data):
    counts = EncodeCounts()
    d = DataConfig(max_seq_length=max_seq_length, **data)
    return encode_rows(rows(examples), tokenizer, d, loss_on, "train", counts), counts


CHAT = {"messages": [{"role": "system", "content": "answer briefly"},
                     {"role": "user", "content": "where does anna live ?"},
                     {"role": "assistant", "content": "paris"},
                     {"role": "user", "content": "who does ben work for ?"},
                     {"role": "assistant", "content": "acme"}]}


def test_the_loss_is_on_every_assistant_turn_and_its_end_only(tokenizer):
    ds, counts = encoded(tokenizer, [CHAT])
    assert labelled_text(tokenizer, ds[0]["input_ids"], ds[0]["labels"]) == \
        ["paris [SEP]", "acme [SEP]"]
    assert (counts.examples, counts.truncated, counts.dropped) == (1, 0, 0)
    every, _ = encoded(tokenizer, [CHAT], loss_on="all")
    assert every[0]["labels"] == every[0]["input_ids"]


def test_prompt_response_rows_with_and_without_a_template(tokenizer, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="rapidformer")
    row = {"prompt": "question : where does anna live ? answer :", "response": " paris"}
    ds, _ = encoded(tokenizer, [row])
    assert "has no chat template" not in caplog.text
    assert labelled_text(tokenizer, ds[0]["input_ids"], ds[0]["labels"]) == ["paris [SEP]"]
    assert tokenizer.decode(ds[0]["input_ids"]).startswith("< | user | > question")
    plain = with_template(tokenizer, None)
    ds, _ = encoded(plain, [row])
    # the run says how it joins rows without a template (a base model's tokenizer)
    assert "the tokenizer has no chat template (data.chat_template gives one): each row is its " \
        "prompt, then its response" in caplog.text
    assert tokenizer.decode(ds[0]["input_ids"]) == "question : where does anna live? answer : " \
                                                   "paris [SEP]"
    assert labelled_text(plain, ds[0]["input_ids"], ds[0]["labels"]) == ["paris [SEP]"]
    with pytest.raises(InputError, match="conversations need a chat template"):
        encoded(plain, [CHAT])


def test_long_rows_are_cut_and_rows_without_an_answer_left_are_dropped(tokenizer):
    long_prompt = {"messages": [{"role": "user", "content": "where does anna live ? " * 20},
                                {"role": "assistant", "content": "paris"}]}
    no_answer = {"messages": [{"role": "user", "content": "where does anna live ?"}]}
    short = {"messages": [{"role": "user", "content": "where ?"},
                          {"role": "assistant", "content": "paris"}]}
    ds, counts = encoded(tokenizer, [long_prompt, no_answer, short], max_seq_length=32)
    assert (counts.examples, counts.truncated, counts.dropped) == (3, 1, 2)
    assert len(ds) == 1 and len(ds[0]["input_ids"]) <= 32


@pytest.mark.parametrize("example, message", [
    ({"text": "hello"}, "task=sft reads a conversation column (data.messages_column=messages"),
    ({"messages": "hello"}, "train row 1: messages must be a non-empty list"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "message 1 must be {\"role\": one of"),
    ({"prompt": 3, "response": "x"}, "data.prompt_column holds int, not text"),
])
def test_malformed_rows_are_refused_with_the_row(tokenizer, example, message):
    with pytest.raises(InputError) as info:
        encoded(tokenizer, [example])
    assert message in str(info.value)


def test_a_template_that_does_not_render_turns_in_order_is_refused(tokenizer):
    # puts the last turn first: the prefix of a conversation is not the start of its text
    reordering = with_template(tokenizer, "{% for m in messages|reverse %}{{ m['content'] }} "
                                          "{% endfor %}{% if add_generation_prompt %}: {% endif %}")
    with pytest.raises(InputError, match="cannot be told apart; use task.loss_on=all"):
        encoded(reordering, [CHAT])
    ds, _ = encoded(reordering, [CHAT], loss_on="all")
    assert len(ds) == 1


def test_generation_prompts_end_before_the_last_answer(tokenizer):
    prompts = generation_prompts(rows([CHAT]), tokenizer, DataConfig(), 4)
    assert prompts == [{"prompt": "<|system|> answer briefly<|user|> where does anna live ?"
                                  "<|assistant|> paris [SEP]<|user|> who does ben work for ?"
                                  "<|assistant|> ", "reference": "acme"}]


def test_packed_rows_give_the_unpacked_batch_loss(tokenizer):
    """Three examples in one packed row (and, beside it, a shorter packed row padded to its
    length) give the loss of the same examples padded one per row: no attention across
    examples, positions restart, no example predicts the next one's first token."""
    from transformers import DataCollatorForSeq2Seq

    from rapidformer.models.attention import use_training_sdpa

    examples = [CHAT, {"prompt": "where does anna live ?", "response": "paris"},
                {"messages": CHAT["messages"][1:3]}, {"messages": CHAT["messages"][3:]}]
    chats = [e if "messages" in e else {"messages": [{"role": "user", "content": e["prompt"]},
                                                     {"role": "assistant",
                                                      "content": e["response"]}]}
             for e in examples]
    ds, _ = encoded(tokenizer, chats)
    model = tiny_llama(vocab_size=len(tokenizer))
    use_training_sdpa(model)
    padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE,
                                    return_tensors="pt")(list(ds))
    lengths = [len(ids) for ids in ds["input_ids"]]
    # rows of the three longest examples' total: best-fit decreasing puts those three in the
    # first row and the shortest alone in the second
    packed_ds = pack(ds, sum(sorted(lengths)[-3:]))
    assert list(packed_ds["num_examples"]) == [3, 1]
    assert len(packed_ds["input_ids"][1]) == min(lengths)
    packed = PackedCollate(tokenizer.pad_token_id)(list(packed_ds))
    counts = take_counts(packed)  # what the metrics window reads, not the model
    assert counts.samples == 4
    assert counts.tokens == int(padded["attention_mask"].sum())
    assert counts.slots == packed["input_ids"].numel()

    def loss(batch):
        return float(model(input_ids=batch["input_ids"], labels=batch["labels"],
                           attention_mask=batch.get("attention_mask"),
                           position_ids=batch.get("position_ids"), use_cache=False).loss)

    with torch.no_grad():
        assert loss(packed) == pytest.approx(loss(padded), rel=1e-5)
        # the test bites: positions that do not restart let the examples see each other
        joined = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).expand(2, -1))
        assert loss(joined) != pytest.approx(loss(padded), rel=1e-3)


def _first_fit_by_scan(lengths, capacity):
    """Best-fit decreasing the slow way: every open bin scanned for the fullest that fits."""
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if 0 < lengths[i] <= free[b]]
        if fits:
            b = min(fits, key=lambda b: free[b])
            bins[b].append(i)
            free[b] -= lengths[i]
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return sorted(free)


@pytest.mark.parametrize("capacity", [1, 5, 64, 2048])
def test_best_fit_decreasing_fills_rows_as_a_scan_of_every_row_does(capacity):
    import random

    from rapidformer.data.chat import best_fit_decreasing

    rng = random.Random(capacity)
    for _ in range(60):
        lengths = [rng.randint(1, capacity + 2) for _ in range(rng.randint(0, 80))]
        bins = best_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(b == sorted(b) for b in bins)  # the data's order inside a row
        # a row over capacity holds one example longer than it, alone
        assert all(sum(lengths[i] for i in b) <= capacity or len(b) == 1 for b in bins)
        assert sorted(capacity - sum(lengths[i] for i in b) for b in bins) == \
            _first_fit_by_scan(lengths, capacity)


def test_packing_chats_of_instruction_lengths_leaves_under_one_percent_empty():
    import random

    from rapidformer.data.chat import best_fit_decreasing

    rng = random.Random(0)
    lengths = [min(2048, int(rng.lognormvariate(5.3, 0.8))) + 1 for _ in range(20000)]
    bins = best_fit_decreasing(lengths, 2048)
    assert sum(lengths) / (2048 * len(bins)) > 0.99
    # what filling rows in the data's order left: a row closes when the next example overflows
    rows, used = 1, 0
    for n in lengths:
        if used + n > 2048:
            rows, used = rows + 1, 0
        used += n
    assert sum(lengths) / (2048 * rows) < 0.95


def sft_args(data_dir) -> list[str]:
    return ["+recipe=llama_sft", f"data.path={data_dir}", "data.synthetic_train_size=480",
            "data.synthetic_eval_size=16", "trainer.epochs=null", "trainer.train_iters=90",
            "trainer.eval_interval=30", "trainer.log_interval=10", "trainer.device=cpu",
            "task.sample_generations=8", *QUIET]


@pytest.mark.parametrize("packing", [False, True])
def test_llama_sft_learns_its_answers_and_exports_a_chat_model(tmp_path, packing, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    records = pretrain(run, [*sft_args(tmp_path / "data"), f"data.packing={packing}"])
    matches = [r["validation/answer_match"] for r in records if "validation/answer_match" in r]
    assert matches[-1] >= 0.9 > matches[0], matches  # the answers become right
    losses = [r["validation/loss"] for r in records if "validation/loss" in r]
    assert losses[-1] < losses[0] / 3
    generations = [json.loads(line) for line in (run / "generations.jsonl").read_text()
                   .splitlines()]
    assert len(generations) == 8 * len(matches)
    assert {g["step"] for g in generations} == {30, 60, 90}
    last = generations[-8:]
    assert sum(g["generated"] == g["reference"] for g in last) / 8 == matches[-1]
    if packing:  # fewer rows than examples, every example counted as a sample
        windows = [r for r in records if "samples_per_s" in r]
        assert windows and all(r["padding_frac"] < 0.3 for r in windows)
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    assert tokenizer.chat_template and tokenizer.eos_token == "[SEP]"
    model = AutoModelForCausalLM.from_pretrained(run / "hf_model")
    assert answer(model, tokenizer, "where does anna live ?") == "paris"
    if not packing:
        check_generate_verb(run, tmp_path, capsys)


def prompt_ids(tokenizer, question: str):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]


def answer(model, tokenizer, question: str) -> str:
    """A chat model's greedy answer to one user turn."""
    ids = prompt_ids(tokenizer, question)
    out = model.generate(ids, max_new_tokens=6, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def check_generate_verb(run, tmp_path, capsys):
    """`rapidformer generate` answers a prompt and a jsonl of conversations and prompts from
    the export; bad input is one message and exit 2."""
    import yaml

    from rapidformer.cli.verbs import run_verb
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    resolved, _ = settle(compose([*sft_args(tmp_path / "data"), f"trainer.output_dir={run}"]),
                          str(run))
    (run / "config.yaml").write_text(yaml.safe_dump(resolved))  # what the CLI writes first
    capsys.readouterr()
    assert run_verb("generate", [str(run), "--prompt", "who does anna work for ?"]) == 0
    assert capsys.readouterr().out.strip() == "acme"
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "where does ben carter "
                                                                         "live ?"}]}) + "\n" +
                    json.dumps({"prompt": "where does dora live ?"}) + "\n")
    out = tmp_path / "answers.jsonl"
    assert run_verb("generate", [str(run), "--input", str(rows), "--output", str(out)]) == 0
    assert [json.loads(line)["generated"] for line in out.read_text().splitlines()] == \
        ["new york", "osaka"]
    rows.write_text('{"question": "where ?"}\n')
    assert run_verb("generate", [str(run), "--input", str(rows)]) == 2
    assert "row 1: needs a 'messages' conversation or a 'prompt' text" in capsys.readouterr().err
    assert run_verb("generate", [str(run), "--prompt", "x", "--model", str(tmp_path)]) == 2
    assert "holds no exported model (no config.json)" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["model=bert_tiny"], "task=sft fine-tunes a Hugging Face causal LM; model=bert_tiny"),
    (["model=megatron_gpt_tiny"], "task=sft fine-tunes a Hugging Face causal LM"),
])
def test_sft_refuses_models_that_are_not_decoders(overrides, message):
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        settle(compose(["+recipe=llama_sft", *overrides]), "/nonexistent")


def test_packing_is_refused_outside_sft():
    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="data.packing=true packs examples for task=sft"):
        settle(compose(["data.packing=true"]), "/nonexistent")


def test_sft_refuses_trainer_unpad(tmp_path):
    from rapidformer.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.unpad=true with task=sft: not yet.*data.packing=true"):
        pretrain(tmp_path / "run", [*sft_args(tmp_path / "data"), "trainer.unpad=true"])



def test_best_fit_decreasing_leaves_out_examples_of_no_tokens():
    from rapidformer.data.chat import best_fit_decreasing

    assert best_fit_decreasing([0, 3, 0, 1], 4) == [[1, 3]]
    assert best_fit_decreasing([], 4) == []
