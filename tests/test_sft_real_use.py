"""SFT as real tokenizers and templates meet it (a review with real-format models): generation
stops where the template ends a turn, a template's refusal is one message naming the row, a
base tokenizer's BOS begins joined rows, rows with function calls are refused, batches pad on
the right whatever the tokenizer's side, and prompts the model cannot answer are left out."""
from __future__ import annotations

import pytest

from rapidformer.config.schema import DataConfig
from rapidformer.data.chat import (EncodeCounts, Renderer, encode_rows, generation_prompts,
                                   stop_token_ids)
from rapidformer.errors import InputError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<pad>"]


def bpe_tokenizer(bos_first: bool = False, template: str | None = None, **special):
    """A byte-level BPE tokenizer built here: Llama's way (every text begins with <s>) or
    GPT-2's (nothing added), with or without a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["where does anna live ? paris . who is ben ? acme user assistant "
                             "system question answer"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    if bos_first:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    if template:
        wrapped.chat_template = template
    return wrapped


def rows(examples):
    from datasets import Dataset

    return Dataset.from_list(examples)


def test_generation_stops_at_the_templates_end_of_turn_and_the_models_own():
    from transformers import GenerationConfig

    tok = bpe_tokenizer(template=CHATML, eos_token="<|endoftext|>", pad_token="<pad>")
    im_end, text_end = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert Renderer(tok).turn_end_id() == im_end
    assert stop_token_ids(tok) == [text_end, im_end]
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[im_end, 7])) == \
        [text_end, im_end, 7]
    plain = bpe_tokenizer(eos_token="</s>")  # no template: the end of sequence alone
    assert stop_token_ids(plain) == [plain.eos_token_id]
    # a template whose turns end in plain text adds nothing
    words = bpe_tokenizer(template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
                          eos_token="</s>")
    assert Renderer(words).turn_end_id() is None


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
     "not supported') }}{% endif %}{{ m['content'] }}{% endfor %}",
     "train row 2: the chat template refuses the conversation"),
    ("{% for m in messages %}{{ m['content'] }{% endfor %}", "the chat template does not parse"),
])
def test_a_templates_refusal_is_one_message_naming_the_row(template, said):
    tok = bpe_tokenizer(template=template, eos_token="</s>", pad_token="<pad>")
    chats = [{"messages": [{"role": "user", "content": "where ?"},
                           {"role": "assistant", "content": "paris"}]},
             {"messages": [{"role": "system", "content": "answer"},
                           {"role": "user", "content": "where ?"},
                           {"role": "assistant", "content": "paris"}]}]
    with pytest.raises(InputError, match=said):
        encode_rows(rows(chats), tok, DataConfig(), "response", "train", EncodeCounts())


@pytest.mark.parametrize("bos_first", [True, False])
def test_rows_joined_without_a_template_begin_as_the_tokenizer_begins_a_text(bos_first):
    tok = bpe_tokenizer(bos_first, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    encoded = encode_rows(rows([{"prompt": "where does anna live ?", "response": " paris"}]),
                          tok, DataConfig(), "response", "train", EncodeCounts())
    ids = encoded[0]["input_ids"]
    assert (ids[0] == tok.bos_token_id) == bos_first and ids.count(tok.bos_token_id) <= 1
    assert ids[-1] == tok.eos_token_id and encoded[0]["labels"][-1] == tok.eos_token_id


def test_function_calls_are_refused_names_are_kept_and_empty_answers_counted():
    tok = bpe_tokenizer(template=CHATML, eos_token="<|im_end|>", pad_token="<pad>")
    call = {"messages": [{"role": "user", "content": "where ?"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "find", "arguments": "{}"}}]},
                         {"role": "tool", "name": "find", "content": "paris"},
                         {"role": "assistant", "content": "paris"}]}
    with pytest.raises(InputError, match="message 2 holds tool_calls: rows with function calls "
                                         "are not supported yet"):
        encode_rows(rows([call]), tok, DataConfig(), "response", "train", EncodeCounts())
    counts = EncodeCounts()
    empty = {"messages": [{"role": "user", "content": "where ?"},
                          {"role": "assistant", "content": ""}]}
    full = {"messages": [{"role": "user", "content": "where ?"},
                         {"role": "assistant", "content": "paris"}]}
    encode_rows(rows([empty, full]), tok, DataConfig(), "response", "train", counts)
    assert counts.empty_answers == 1
    from rapidformer.data.chat import messages_of

    named = messages_of({"messages": call["messages"][2:]}, "messages", DataConfig(), "row")
    assert named[0]["name"] == "find"


def test_batches_pad_on_the_right_and_the_tokenizer_keeps_its_side():
    from transformers import DataCollatorForSeq2Seq

    from rapidformer.tasks.batching import RightPadded

    tok = bpe_tokenizer(eos_token="</s>", pad_token="<pad>")
    tok.padding_side = "left"
    collate = RightPadded(DataCollatorForSeq2Seq(tok, label_pad_token_id=-100), tok)
    batch = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
                     {"input_ids": [5], "labels": [5]}])
    assert batch["input_ids"][1].tolist() == [5, tok.pad_token_id, tok.pad_token_id]
    assert batch["labels"][1].tolist() == [5, -100, -100]
    assert batch["attention_mask"][1].tolist() == [1, 0, 0]
    assert tok.padding_side == "left"


def test_prompts_the_run_cannot_train_on_are_not_generation_prompts(caplog):
    tok = bpe_tokenizer(template=CHATML, eos_token="<|im_end|>", pad_token="<pad>")
    long = " ".join(["where does anna live ?"] * 40)
    chats = [{"prompt": long, "response": "paris"}, {"prompt": "who is ben ?",
                                                     "response": "acme"}]
    found = generation_prompts(rows(chats), tok, DataConfig(max_seq_length=64), 4)
    assert [p["reference"] for p in found] == ["acme"]
    assert "1 validation prompts of data.max_seq_length=64 tokens or more" in caplog.text


@pytest.mark.parametrize("model_type, positions, prompt, wanted, room", [
    ("gpt2", 256, 250, 32, 6), ("gpt2", 256, 10, 32, 32), ("gpt2", 256, 256, 32, 0),
    ("roberta", 514, 500, 32, 12), ("llama", 2048, 4000, 32, 32),  # rotary: no table
])
def test_a_generation_ends_where_the_learned_positions_do(model_type, positions, prompt,
                                                          wanted, room):
    from types import SimpleNamespace

    from rapidformer.models.pretrained_shape import new_token_room

    name = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
    config = SimpleNamespace(model_type=model_type, **{name: positions})
    assert new_token_room(config, prompt, wanted) == room


def test_generate_from_an_adapter_directory_says_to_export_a_whole_model(tmp_path):
    from rapidformer.cli.verbs.generate import load_exported

    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(InputError, match=r"holds LoRA adapters alone .*`rapidformer export"):
        load_exported(tmp_path)


def test_a_joined_row_begins_as_the_tokenizer_begins_a_text_sentencepiece_too():
    """A Metaspace (SentencePiece) tokenizer marks a text's first word ('_where') only at the
    text's start: the BOS goes in as an id, so the row's first word is the one the base model
    saw after BOS (as text, '<s>where' cut it otherwise)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(["where does anna live ? paris"] * 20,
                            trainers.BpeTrainer(vocab_size=120,
                                                special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", unk_token="<unk>")
    encoded = encode_rows(rows([{"prompt": "where does anna live ?", "response": " paris"}]),
                          wrapped, DataConfig(), "response", "train", EncodeCounts())
    alone = wrapped("where does anna live ?")["input_ids"]  # <s> and the prompt's own ids
    assert encoded[0]["input_ids"][:len(alone)] == alone


def test_predictions_of_a_gpt2_classifier_do_not_depend_on_the_batch_size():
    """A left-padding tokenizer: predict pads on the right, as training and eval do (GPT-2's
    learned positions read left-padded rows shifted: 14 of 16 rows changed with the batch)."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from rapidformer.config.schema import RunConfig
    from rapidformer.inference.predictors import Predicting, sequence_classification

    tok = bpe_tokenizer(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.padding_side = "left"
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, num_labels=2,
        pad_token_id=tok.pad_token_id)).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(30)  # positions that matter
    cfg = RunConfig()
    cfg.data.text_a_column, cfg.data.text_b_column = "sentence", None
    rows = [{"sentence": text} for text in ("where", "where does anna live ?", "who is ben ?",
                                            "paris . acme")]
    scores = {size: [r["score"] for r in sequence_classification(
        Predicting(model, tok, cfg, torch.device("cpu"), size), rows)] for size in (1, 4)}
    assert scores[4] == pytest.approx(scores[1], rel=1e-5)
