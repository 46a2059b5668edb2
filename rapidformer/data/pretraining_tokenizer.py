"""The pretraining tokenizer of a run: built once per process from model.tokenizer_type,
model.tokenizer (the vocab file, or a tokenizer directory for HuggingFaceTokenizer) and
model.merge_file — the same files and types that rapidformer-preprocess-data takes, so training
reads the data with the vocabulary that wrote it."""
from __future__ import annotations

from rapidformer.config.schema import ModelConfig
from rapidformer.data.megatron import MegatronTokenizer
from rapidformer.data.preprocess_data import PreprocessError, build_tokenizer
from rapidformer.errors import InputError

_CACHE: dict = {}


def load_pretraining_tokenizer(m: ModelConfig) -> MegatronTokenizer:
    if not m.tokenizer_type:
        raise InputError("pretraining needs the tokenizer its data was made with: set "
                         "model.tokenizer_type (BertWordPieceLowerCase, BertWordPieceCase, "
                         "GPT2BPETokenizer or HuggingFaceTokenizer) and model.tokenizer")
    key = (m.tokenizer_type, m.tokenizer, m.merge_file)
    if key not in _CACHE:
        directory = m.tokenizer if m.tokenizer_type == "HuggingFaceTokenizer" else None
        try:
            hf, eod, _ = build_tokenizer(m.tokenizer_type, m.tokenizer, m.merge_file, directory)
        except PreprocessError as exc:
            raise InputError(f"{exc} (config keys: model.tokenizer is --vocab-file or the "
                             f"tokenizer directory, model.merge_file is --merge-file)") from exc
        _CACHE[key] = MegatronTokenizer.from_hf(hf, eod)
    return _CACHE[key]
