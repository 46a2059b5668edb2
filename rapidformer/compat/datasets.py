"""The seed's dataset builders for white-box pretraining scripts (Megatron's signatures), reading
the active run's tokenizer and data settings; their index caches live in the run directory,
not beside the (maybe shared or read-only) data."""
from __future__ import annotations

from pathlib import Path

from rapidformer.compat.args import active, get_args
from rapidformer.compat.tokenizer import get_tokenizer
from rapidformer.data.megatron import build_bert_datasets, build_gpt_datasets, check_data_impl


def _index_cache() -> Path:
    return Path(active().run_dir) / "data_index_cache"


def build_train_valid_test_datasets_for_huggingface(
        data_prefix, data_impl, splits_string, train_valid_test_num_samples, max_seq_length,
        masked_lm_prob, short_seq_prob, seed, skip_warmup, binary_head=True):
    """The seed's BERT pretraining datasets: megatron-core's masked word-piece dataset over
    sentence-level mmap data, with samples under Hugging Face's keys (input_ids, attention_mask,
    token_type_ids, labels (-100 where not masked), next_sentence_label). The tokenizer is the
    run's (model.tokenizer_type, model.tokenizer)."""
    check_data_impl(data_impl)
    return build_bert_datasets(data_prefix, get_tokenizer(), splits_string,
                               list(train_valid_test_num_samples), max_seq_length,
                               masked_lm_prob, short_seq_prob, seed, binary_head=binary_head,
                               skip_warmup=skip_warmup, path_to_cache=_index_cache())


def build_train_valid_test_datasets(data_prefix, data_impl, splits_string,
                                    train_valid_test_num_samples, seq_length, seed, skip_warmup):
    """The seed's GPT pretraining datasets (Megatron's signature): megatron-core's GPTDataset
    over document-level mmap data; each sample's `text` holds seq_length + 1 tokens, and
    `input_ids`, `labels` (shifted, -100 where masked) and `position_ids` are ready to use."""
    check_data_impl(data_impl)
    d = get_args().cfg.data
    return build_gpt_datasets(data_prefix, get_tokenizer(), splits_string,
                              list(train_valid_test_num_samples), seq_length, seed,
                              eod_mask_loss=d.eod_mask_loss,
                              reset_position_ids=d.reset_position_ids, skip_warmup=skip_warmup,
                              path_to_cache=_index_cache())
