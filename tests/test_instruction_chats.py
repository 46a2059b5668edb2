"""data.synthetic_lengths=instruction: generated chats of the lengths of real instruction data
(log-normal, mean about 250 words, up to about 4,096), each reply beginning with its question's
fixed answer; model.embedding_rows gives a config-built model a real model's output size beside
a small tokenizer. The realistic SFT workload of the LoRA benchmarks (benchmarks/lora_sft.py)."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from rapidformer.data.synthetic_tasks import _facts, PEOPLE, QUESTIONS, instruction_chat_example
from rapidformer.config.compose import compose
from rapidformer.errors import InputError
from rapidformer.preflight import settle
from tests.test_decoders import pretrain


def _answer_of(question: str) -> str:
    for person, words in enumerate(PEOPLE):
        for kind, text in QUESTIONS.items():
            if question.endswith(text.format(" ".join(words))):
                return _facts(person)[kind]
    raise AssertionError(f"no fixed question in {question[-60:]!r}")


def test_the_lengths_follow_real_instruction_data_and_every_reply_begins_with_its_answer():
    rng = random.Random(7)
    chats = [instruction_chat_example(rng)["messages"] for _ in range(5000)]
    words = sorted(sum(len(m["content"].split()) for m in c) for c in chats)
    assert 220 < statistics.mean(words) < 310 and 150 < words[len(words) // 2] < 230
    assert words[-1] <= 4096 + 40 and words[int(0.99 * len(words))] > 900  # a long tail
    replies = sum(len(m["content"].split()) for c in chats for m in c if m["role"] == "assistant")
    assert 0.7 < replies / sum(words) < 0.85  # most tokens are the assistant's, as in real sets
    for chat in chats[:500]:
        turns = [m for m in chat if m["role"] != "system"]
        for user, reply in zip(turns[::2], turns[1::2]):
            assert (user["role"], reply["role"]) == ("user", "assistant")
            assert reply["content"].startswith(_answer_of(user["content"]) + " .")


def test_an_sft_run_on_instruction_lengths_with_a_real_models_output_size(tmp_path):
    from rapidformer.engine import RapidformerEngine
    from rapidformer.tasks import task_class

    run = tmp_path / "run"
    _, cfg = settle(compose([
        "+recipe=llama_sft", f"data.path={tmp_path / 'data'}", "data.synthetic_lengths=instruction",
        "data.synthetic_train_size=64", "data.synthetic_eval_size=8", "data.max_seq_length=1024",
        "data.packing=true", "model.embedding_rows=4096", "model.max_position_embeddings=1024",
        "trainer.epochs=null",
        "trainer.train_iters=3", "trainer.eval_interval=3", "trainer.log_interval=1",
        "trainer.device=cpu", "task.sample_generations=0", "trainer.export_hf=false",
        f"trainer.output_dir={run}"]), str(run))
    task = task_class("sft")(engine=RapidformerEngine(cfg, run))
    task.train()
    model = task.engine.model
    assert model.get_output_embeddings().weight.shape[0] == 4096
    assert model.get_input_embeddings().weight.shape[0] == 4096
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").open()]
    assert statistics.mean(sum(len(m["content"].split()) for m in r["messages"])
                           for r in rows) > 150
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    # real tokens a conversation: a few hundred, not a few dozen
    assert all(r["tokens_per_s"] / r["samples_per_s"] > 150 for r in records if "loss" in r)
    # the first step's seconds, once, in the first record: within that record's window
    timed = [r for r in records if "first_step_s" in r]
    assert [r["step"] for r in timed] == [1]
    assert 0 < timed[0]["first_step_s"] <= timed[0]["window_s"]


def test_fewer_embedding_rows_than_tokens_are_refused(tmp_path):
    with pytest.raises(InputError, match=r"model.embedding_rows=8 is fewer than the tokenizer's"):
        pretrain(tmp_path / "run", ["+recipe=llama_sft", f"data.path={tmp_path / 'data'}",
                                    "data.synthetic_train_size=16", "data.synthetic_eval_size=4",
                                    "model.embedding_rows=8", "trainer.epochs=null",
                                    "trainer.train_iters=1", "trainer.device=cpu"])
