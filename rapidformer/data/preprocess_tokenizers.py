"""The tokenizer files of `preprocess_data` (`--tokenizer-type`, `--vocab-file`,
`--merge-file`, `--tokenizer-model`) -> the tokenizer, its end-of-document id and its
vocabulary size, as Megatron-LM's tools build them; every unusable file is refused with a
message naming it and the fix. The pretraining data loader builds its tokenizer here too."""
from __future__ import annotations

import json
from pathlib import Path

from rapidformer.data.preprocess_errors import PreprocessError, json_type

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer")
# Megatron's BERT tokenizer looks each of these up in the vocabulary file
BERT_SPECIAL_TOKENS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")
# ...and adds these after its entries, in this order, when it lacks them; [EOS] is its eod
MEGATRON_BERT_ADDED = ("[BOS]", "[EOS]")
# --bert-eod: Megatron's [EOS] (the default) or [SEP]
BERT_EODS = ("eos", "sep")


def _read_text(path: str, flag: str) -> str:
    """A tokenizer file as text, or an error naming the line and byte that are not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PreprocessError(f"{path} ({flag}) cannot be read: {exc.strerror}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PreprocessError(f"{path} ({flag}) is not UTF-8 text: line {line}, byte column "
                              f"{column} is 0x{data[exc.start]:02x}; tokenizer files are UTF-8 "
                              f"(is it the right file, or a binary model?)") from exc


def _require_file(path: str | None, flag: str, kind: str, what: str) -> None:
    if not path or not Path(path).is_file():
        raise PreprocessError(f"--tokenizer-type {kind} needs {flag} ({what}); not found: {path}")


def build_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None,
                    tokenizer_path: str | None, bert_eod: str = "sep"):
    """(tokenizer, eod id, vocabulary size) for one of the seed's tokenizer types; every
    unusable file is a PreprocessError naming it and the fix. `bert_eod` (BERT WordPiece only):
    "sep" ends documents with [SEP] in a vocabulary of the file's V entries, "eos" as
    Megatron-LM's BERT tokenizer does, with [EOS] in V + 2 (`megatron_bert_added`); the
    tokenizer itself is the file's either way (Megatron's never matches [BOS]/[EOS] in text)."""
    if kind.startswith("BertWordPiece"):
        tokenizer, sep, size = _bert_tokenizer(kind, vocab_file)
        if bert_eod == "sep":
            return tokenizer, sep, size
        ids, size = megatron_bert_added(tokenizer.get_vocab())
        return tokenizer, ids["[EOS]"], size
    if kind == "GPT2BPETokenizer":
        return _gpt2_tokenizer(vocab_file, merge_file)
    return _hf_tokenizer(tokenizer_path)


def build_rust_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None,
                         tokenizer_path: str | None, bert_eod: str = "sep"):
    """`build_tokenizer` for preprocessing, without importing transformers (about 0.7 s of a
    run's start on 2 cores): for the GPT-2 BPE and BERT WordPiece types, the same Rust
    `tokenizers.Tokenizer` that transformers' GPT2Tokenizer / BertTokenizer put behind them
    (normalizer, pre-tokenizer, model and special tokens: what the ids depend on), built
    from the files directly; tests compare the two. Any other type, or files the Rust
    loaders refuse, go through `build_tokenizer` (and its messages)."""
    if kind == "HuggingFaceTokenizer":
        return build_tokenizer(kind, vocab_file, merge_file, tokenizer_path, bert_eod)
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    if kind == "GPT2BPETokenizer":
        _require_file(vocab_file, "--vocab-file", kind, "a GPT-2 vocab.json")
        _require_file(merge_file, "--merge-file", kind, "a GPT-2 merges.txt")
        vocab = _gpt2_vocab(vocab_file)
        if "<|endoftext|>" not in vocab:
            return build_tokenizer(kind, vocab_file, merge_file, tokenizer_path, bert_eod)
        try:
            tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception:  # transformers' loader names the problem
            return build_tokenizer(kind, vocab_file, merge_file, tokenizer_path, bert_eod)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           trim_offsets=True, use_regex=True)
        tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True,
                                                 normalized=False)])
        return tokenizer, vocab["<|endoftext|>"], tokenizer.get_vocab_size(True)
    _require_file(vocab_file, "--vocab-file", kind, "a WordPiece vocab.txt")
    text = _read_text(vocab_file, "--vocab-file")
    tokens = {line.strip() for line in text.splitlines()}
    if text.lstrip().startswith("{") or any(t not in tokens for t in BERT_SPECIAL_TOKENS):
        return build_tokenizer(kind, vocab_file, merge_file, tokenizer_path, bert_eod)
    try:
        tokenizer = Tokenizer(models.WordPiece.from_file(vocab_file, unk_token="[UNK]"))
    except Exception:
        return build_tokenizer(kind, vocab_file, merge_file, tokenizer_path, bert_eod)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None,
        lowercase=kind.endswith("LowerCase"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")])
    if bert_eod == "sep":
        return tokenizer, tokenizer.token_to_id("[SEP]"), tokenizer.get_vocab_size(True)
    ids, size = megatron_bert_added(tokenizer.get_vocab(True))
    return tokenizer, ids["[EOS]"], size


def megatron_bert_added(vocab: dict) -> tuple[dict, int]:
    """({"[BOS]": id, "[EOS]": id}, vocabulary size) as Megatron-LM's BERT tokenizer has them:
    `_BertWordPieceTokenizer.__init__` calls `add_token("[BOS]")` then `add_token("[EOS]")`,
    which give a token the next id (`len(vocab)`) unless the vocab.txt has it; `vocab_size` is
    then len(vocab), and `eod` is the [EOS] id. For bert-base-uncased's 30,522 entries:
    [BOS] 30522, [EOS] 30523, 30,524 entries."""
    ids, size = {}, len(vocab)
    for token in MEGATRON_BERT_ADDED:
        if token in vocab:
            ids[token] = vocab[token]
        else:
            ids[token], size = size, size + 1
    return ids, size


def _bert_tokenizer(kind: str, vocab_file: str | None):
    from transformers import BertTokenizer

    _require_file(vocab_file, "--vocab-file", kind, "a WordPiece vocab.txt")
    text = _read_text(vocab_file, "--vocab-file")
    if text.lstrip().startswith("{"):
        raise PreprocessError(f"{vocab_file} is a JSON vocabulary (GPT-2 style), not a "
                              f"WordPiece vocab.txt: use --tokenizer-type GPT2BPETokenizer "
                              f"with --merge-file, or give a vocab.txt")
    tokens = {line.strip() for line in text.splitlines()}
    missing = [t for t in BERT_SPECIAL_TOKENS if t not in tokens]
    if missing:
        # transformers would add them after the file's entries, with ids that Megatron's BERT
        # tokenizer, reading the same file, does not have
        raise PreprocessError(f"{vocab_file} (--vocab-file) has no {' '.join(missing)} "
                              f"(one token a line; it has {len(tokens - {''})} entries): a BERT "
                              f"WordPiece vocab.txt holds all of {' '.join(BERT_SPECIAL_TOKENS)}; "
                              f"give the vocab.txt of a BERT model, or add the missing lines")
    try:
        tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=kind.endswith("LowerCase"))
    except Exception as exc:  # the Rust WordPiece loader's own checks
        raise PreprocessError(f"{vocab_file} (--vocab-file) cannot be loaded as a WordPiece "
                              f"vocab.txt: {exc}") from exc
    return tokenizer, tokenizer.sep_token_id, len(tokenizer)


def _gpt2_tokenizer(vocab_file: str | None, merge_file: str | None):
    from transformers import GPT2Tokenizer

    _require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "a GPT-2 vocab.json")
    _require_file(merge_file, "--merge-file", "GPT2BPETokenizer", "a GPT-2 merges.txt")
    vocab = _gpt2_vocab(vocab_file)
    if "<|endoftext|>" not in vocab:
        raise PreprocessError(f"{vocab_file} has no <|endoftext|> token, which GPT-2 "
                              f"tokenization uses as end of document")
    merges = _read_text(merge_file, "--merge-file")
    try:
        tokenizer = GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    except Exception as exc:  # the Rust BPE loader: "Token `qq` out of vocabulary" and the like
        raise PreprocessError(_merges_problem(vocab, merges, vocab_file, merge_file)
                              or f"{vocab_file} (--vocab-file) and {merge_file} (--merge-file) "
                                 f"cannot be loaded as a GPT-2 BPE tokenizer: {exc}") from exc
    return tokenizer, vocab["<|endoftext|>"], len(tokenizer)


def _gpt2_vocab(vocab_file: str) -> dict:
    text = _read_text(vocab_file, "--vocab-file")
    try:
        vocab = json.loads(text)
    except json.JSONDecodeError as exc:
        # a file that starts as JSON is a damaged vocab.json, not a vocab.txt: say where
        damage = f"; its JSON breaks at line {exc.lineno}, column {exc.colno} ({exc.msg})" \
            if text.lstrip().startswith("{") else ""
        raise PreprocessError(f"{vocab_file} is not a GPT-2 vocab.json (JSON); for a "
                              f"WordPiece vocab.txt use --tokenizer-type "
                              f"BertWordPieceLowerCase{damage}") from exc
    if not isinstance(vocab, dict):
        raise PreprocessError(f"{vocab_file} (--vocab-file) is JSON but not a GPT-2 vocabulary: "
                              f"it is {json_type(vocab)}, expected an object mapping each token "
                              f"to its id, as {{\"<|endoftext|>\": 50256, ...}}")
    for token, index in vocab.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise PreprocessError(f"{vocab_file} (--vocab-file), key {token!r}: its id is "
                                  f"{json_type(index)}, expected an integer; a GPT-2 vocab.json "
                                  f"maps each token to its id")
    return vocab


def _merges_problem(vocab: dict, merges: str, vocab_file: str, merge_file: str) -> str | None:
    """Why merges.txt does not load with this vocabulary: the first bad line, named."""
    if merges.lstrip().startswith("{"):
        return (f"{merge_file} (--merge-file) is JSON, not a GPT-2 merges.txt: were "
                f"--vocab-file and --merge-file swapped?")
    first, unknown, total = None, 0, 0
    for number, line in enumerate(merges.splitlines(), start=1):
        if number == 1 and line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            return (f"{merge_file} (--merge-file), line {number}: {line!r} is not two tokens "
                    f"separated by one space (a GPT-2 merges.txt line looks like 'Ġ t'); is it "
                    f"the merges file?")
        total += 1
        if not all(t in vocab for t in (*parts, "".join(parts))):
            unknown += 1
            first = first or (number, line, "".join(parts))
    if first is None:
        return None
    number, line, merged = first
    return (f"{merge_file} (--merge-file) does not match {vocab_file} (--vocab-file): line "
            f"{number}, {line!r}, makes {merged!r}, which that vocabulary does not have "
            f"({unknown} of the {total} merges do not fit it); pass the merges.txt saved "
            f"together with this vocab.json (they come as a pair, e.g. gpt2-vocab.json and "
            f"gpt2-merges.txt)")


def _hf_tokenizer(tokenizer_path: str | None):
    from transformers import AutoTokenizer

    if not tokenizer_path or not Path(tokenizer_path).is_dir():
        raise PreprocessError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model, a "
                              f"local tokenizer directory; not found: {tokenizer_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as exc:  # corrupt or missing tokenizer.json, vocab files, config
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise PreprocessError(f"{tokenizer_path} (--tokenizer-model) does not load as a Hugging "
                              f"Face tokenizer ({type(exc).__name__}: {reason}); give a "
                              f"directory written by tokenizer.save_pretrained()") from exc
    eod = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    return tokenizer, eod, len(tokenizer)
