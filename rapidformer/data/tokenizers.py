"""Tokenizers: a pretrained model's own, a given directory or vocab.txt, or a WordPiece
vocabulary trained on the training split for a config-built model (no download needed)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

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
    check_tokenizer_path(path)
    raise InputError(f"tokenizer at {path} (model.tokenizer) is neither a file nor a directory; "
                     f"give a tokenizer directory or a WordPiece vocab.txt")


def check_tokenizer_path(path: str | os.PathLike) -> None:
    """model.tokenizer of a fine-tuning run names a file or directory that exists (asked by the
    refusal pass too, before the run starts)."""
    if not Path(path).exists():
        raise InputError(f"tokenizer not found: {path} (model.tokenizer); give a tokenizer "
                         f"directory or a WordPiece vocab.txt, or leave model.tokenizer=null")


def train_wordpiece(texts: Iterable[str], out_dir: Path, vocab_size: int, lowercase: bool,
                    max_length: int):
    """The tokenizer of `wordpiece_vocabulary(texts, ...)`, saved to out_dir."""
    vocab = wordpiece_vocabulary(texts, vocab_size, lowercase)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_file = out_dir / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = load_tokenizer(vocab_file, lowercase, max_length)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def wordpiece_vocabulary(texts: Iterable[str], vocab_size: int, lowercase: bool) -> list[str]:
    """A WordPiece vocabulary from the corpus: the special tokens, every character (alone and as
    a `##` continuation, so no word is ever unknown), then the most frequent whole words, up to
    `vocab_size` entries in all (fewer when the corpus has fewer words: the model's embeddings,
    and so its parameter count, follow the vocabulary, not model.vocab_size).

    Written by hand rather than with `tokenizers`' trainer, whose merges break ties in hash
    order: the same corpus must give the same vocabulary, or runs and resumes are not
    reproducible.
    """
    from collections import Counter

    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(lowercase=lowercase)
    pre_tokenizer = BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    if not counts:
        raise InputError("cannot train a tokenizer: the training texts are empty")
    chars = sorted({c for word in counts for c in word})
    vocab = SPECIAL_TOKENS + chars + [f"##{c}" for c in chars]
    taken = set(vocab)
    words = sorted((w for w in counts if w not in taken), key=lambda w: (-counts[w], w))
    return vocab + words[:max(vocab_size - len(vocab), 0)]


def training_texts(task: str, d, train) -> Iterator[str]:
    """The texts of the training split (`train`, a datasets.Dataset) that a config-built model's
    vocabulary is trained on, for each fine-tuning task (`d`: the data config naming the
    columns). The tasks and the memory plan both read them here, so that the plan counts the
    embeddings training builds."""
    if task == "sequence_classification":
        columns = [d.text_a_column] + ([d.text_b_column] if d.text_b_column else [])
        return (str(x) for column in columns for x in train[column])
    if task == "token_classification":
        return (" ".join(row) for row in train[d.tokens_column])
    if task == "question_answering":
        return (text for row in train.select_columns([d.question_column, d.context_column])
                for text in row.values())
    if task == "masked_lm":
        return (str(x) for x in train[d.text_column])
    if task == "seq2seq_lm":
        return (str(text) for column in (d.document_column, d.summary_column)
                for text in train[column])
    if task == "sft":
        return _conversation_texts(d, train)
    raise ValueError(f"task={task} trains no WordPiece vocabulary")


def _conversation_texts(d, train) -> Iterator[str]:
    """The turns' texts, the role names, and the chat template's markup (its characters must
    be in the vocabulary, or the rendered conversations hold unknown tokens)."""
    from rapidformer.data.chat import chat_template_text, messages_of, row_form, ROLES
    from rapidformer.data.text_classification import row_place

    form = row_form(train.column_names, d)
    yield " ".join(ROLES)
    yield chat_template_text(d.chat_template) or ""
    place = row_place("train", train, d)
    for index, row in enumerate(train):
        for message in messages_of(row, form, d, lambda index=index: place(index)):
            yield message["content"]


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
    # trained aside and moved into place whole: a run stopped while it saved (a kill, a full
    # disk) leaves no half-written tokenizer/ that every later run would trust and fail on
    import shutil

    partial = save_dir.with_name(f".tmp-{save_dir.name}-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = train_wordpiece(train_texts(), partial, m.vocab_size, m.lowercase, max_length)
    shutil.rmtree(save_dir, ignore_errors=True)  # a stopped run's, without its config
    os.replace(partial, save_dir)
    return load_tokenizer(save_dir, m.lowercase, max_length)


def ready_to_pad(tokenizer):
    """The tokenizer, with a padding token: a decoder's (GPT-2, Llama) has none, and a batch of
    sentences of other lengths is padded with its end-of-sequence token (what their classifiers
    take as the padding id, config.pad_token_id, to find each sentence's last token)."""
    if tokenizer.pad_token is None:
        stand_in = tokenizer.eos_token or tokenizer.sep_token
        if stand_in is None:
            raise InputError(f"the tokenizer ({type(tokenizer).__name__}) has no padding token "
                             f"and no end-of-sequence token to pad with; add a pad_token to its "
                             f"tokenizer_config.json (or special_tokens_map.json)")
        tokenizer.pad_token = stand_in
    return tokenizer


def pad_id_into(config, tokenizer) -> None:
    """A classifier's config without a padding id (a decoder's) takes the tokenizer's, which
    ready_to_pad gave it: its classifier finds each sentence's last token by that id."""
    if tokenizer is not None and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id


def unreachable_model_message(name: str, what: str = "model") -> str:
    return (f"cannot load the {what} '{name}' (model.name_or_path): it is not a local directory "
            f"and not in the Hugging Face cache, and the hub cannot be reached. Fix: download it "
            f"once where there is network (e.g. `hf download {name}`), point model.name_or_path at "
            f"a local directory, or use model=bert_tiny (built from a config, no download)")
