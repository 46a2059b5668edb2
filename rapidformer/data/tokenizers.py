"""Tokenizers: a pretrained model's own, a given directory or vocab.txt, or a WordPiece
vocabulary trained on the training split for a config-built model (no download needed)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from rapidformer.config.schema import ModelConfig
from rapidformer.errors import InputError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_tokenizer(path: str | os.PathLike, lowercase: bool = True, max_length: int | None = None):
    from transformers import AutoTokenizer, BertTokenizer

    path = Path(path)
    kwargs = {"model_max_length": max_length} if max_length else {}
    if path.is_file():
        return BertTokenizer(vocab=str(path), do_lower_case=lowercase, **kwargs)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    raise InputError(f"tokenizer not found: {path} (model.tokenizer); give a tokenizer directory "
                     f"or a WordPiece vocab.txt, or leave model.tokenizer=null")


def train_wordpiece(texts: Iterable[str], out_dir: Path, vocab_size: int, lowercase: bool,
                    max_length: int):
    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=lowercase)
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1,
                                special_tokens=SPECIAL_TOKENS, show_progress=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer.save_model(str(out_dir))
    tokenizer = load_tokenizer(out_dir / "vocab.txt", lowercase, max_length)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tokenizer(m: ModelConfig, train_texts: Callable[[], Iterable[str]], save_dir: Path,
                    max_length: int):
    """The tokenizer for this run; a trained one is saved to save_dir and reused on resume."""
    if m.tokenizer:
        return load_tokenizer(m.tokenizer, m.lowercase, max_length)
    if m.source == "pretrained":
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(m.name_or_path)
        except (OSError, ValueError) as exc:
            raise InputError(unreachable_model_message(m.name_or_path, "tokenizer")) from exc
    if (save_dir / "tokenizer_config.json").exists():
        return load_tokenizer(save_dir, m.lowercase, max_length)
    return train_wordpiece(train_texts(), save_dir, m.vocab_size, m.lowercase, max_length)


def unreachable_model_message(name: str, what: str = "model") -> str:
    return (f"cannot load the {what} '{name}' (model.name_or_path): it is not a local directory "
            f"and not in the Hugging Face cache, and the hub cannot be reached. Fix: download it "
            f"once where there is network (e.g. `hf download {name}`), point model.name_or_path at "
            f"a local directory, or use model=bert_tiny (built from a config, no download)")
