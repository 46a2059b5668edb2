"""Supervised fine-tuning data: conversations (a `messages` column of {role, content}) or
prompt/response rows, rendered to text with a chat template, tokenized, and labelled so that
the loss falls on the assistant's tokens only (task.loss_on=response) or on every token.

Which tokens are the assistant's is read from the rendered text, not from the template's
markup: the conversation up to an assistant turn, rendered with the generation prompt, is a
prefix of the whole conversation's text, and the turn's text (its end-of-turn tokens included,
so that the model learns to stop) runs from there to the end of the conversation rendered up to
that turn. Every token whose characters overlap such a span is the assistant's. This holds for
any template that renders a conversation as the concatenation of its turns, which is what chat
templates do; a template that does not is refused with the turn where it differs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rapidformer.data.counts import with_counts
from rapidformer.data.lengths import IGNORE
from rapidformer.data.text_classification import row_place
from rapidformer.errors import InputError

log = logging.getLogger("rapidformer")
WITHOUT_TEMPLATE = ("task=sft: the tokenizer has no chat template (data.chat_template gives one): "
                    "each row is its prompt, then its response and the end-of-sequence token, "
                    "with no roles or turn markers; conversations of more than one turn are "
                    "refused")

ROLES = ("system", "user", "assistant", "tool")


# --- the rows ----------------------------------------------------------------------------------
def row_form(columns: list[str], d) -> str:
    """'messages' or 'prompt_response': the form of the dataset's rows, by its columns."""
    if d.messages_column in columns:
        return "messages"
    if d.prompt_column in columns and d.response_column in columns:
        return "prompt_response"
    raise InputError(f"task=sft reads a conversation column (data.messages_column="
                     f"{d.messages_column}: a list of {{role, content}}) or prompt and response "
                     f"columns (data.prompt_column={d.prompt_column}, data.response_column="
                     f"{d.response_column}); the data has: {', '.join(columns)}. Set those keys "
                     f"to its columns")


def messages_of(row: dict, form: str, d, where) -> list[dict]:
    """The row as a list of {role, content}, checked. `where` names the row in errors (its
    file and line, counted from 1, where it was read from a file): text, or a function giving
    it, called only for an error."""
    try:
        return _messages(row, form, d)
    except InputError as exc:
        raise InputError(f"{_named(where)}: {exc}") from None


def _named(where) -> str:
    return where() if callable(where) else where


def _messages(row: dict, form: str, d) -> list[dict]:
    if form == "prompt_response":
        prompt, response = row[d.prompt_column], row[d.response_column]
        for key, value in (("prompt_column", prompt), ("response_column", response)):
            if not isinstance(value, str):
                raise InputError(f"data.{key} holds {type(value).__name__}, not text")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    messages = row[d.messages_column]
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{d.messages_column} must be a non-empty list of "
                         f"{{\"role\": ..., \"content\": ...}}, not {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("tool_calls"):
            raise InputError(f"message {i + 1} holds tool_calls: rows with function calls are "
                             f"not supported yet (the calls would be left out of the text the "
                             f"model learns); leave those rows out")
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ROLES:
            raise InputError(f"message {i + 1} must be {{\"role\": one of {', '.join(ROLES)}"
                             f", \"content\": text}}, not {message!r:.80}")
        kept = {"role": message["role"], "content": message["content"]}
        if isinstance(message.get("name"), str):  # a tool's or a speaker's, for the template
            kept["name"] = message["name"]
        checked.append(kept)
    return checked


# --- the template ------------------------------------------------------------------------------
def chat_template_text(value: str | None) -> str | None:
    """data.chat_template: the template's text, or a file holding it."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise InputError(f"data.chat_template={value} is neither a Jinja template (it has no "
                         f"{{{{ or {{%) nor a file; give the template's text or its file")
    return path.read_text(encoding="utf-8")


class Renderer:
    """Conversations -> text, with the tokenizer's chat template (or none: prompt/response
    rows are then joined, prompt + response + end of sequence)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.eos = tokenizer.eos_token or ""
        # a base model's tokenizer that begins every text with BOS (Llama's) was pretrained on
        # texts that begin with it; rows joined without a template begin with it too, as an id
        # before the text's own (as text, a SentencePiece tokenizer would cut the first word
        # otherwise than after the BOS it adds)
        self.bos_id = None if self.templated else bos_it_adds(tokenizer)

    def text(self, messages: list[dict], add_generation_prompt: bool = False,
             where=None) -> str:
        if self.templated:
            try:
                return self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception as exc:  # jinja2's TemplateError: its raise_exception, a syntax error
                if type(exc).__module__.split(".")[0] != "jinja2":
                    raise
                raise template_error(exc, where) from None
        roles = [m["role"] for m in messages]
        if roles not in (["user"], ["user", "assistant"]):
            raise InputError("conversations need a chat template: the tokenizer has none; give "
                             "one with data.chat_template (its text or a file), or use prompt/"
                             "response rows")
        # a prompt and its response, joined
        return "".join(m["content"] for m in messages) + (self.eos if len(messages) == 2 else "")

    def turn_end_id(self) -> int | None:
        """The special token the template ends an assistant turn with (ChatML's <|im_end|>,
        Llama 3's <|eot_id|>), which a model fine-tuned with it learns to stop at; None where
        the turn ends otherwise."""
        if not self.templated:
            return None
        mark = "rapidformer-answer-mark"
        try:
            text = self.text([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": mark}])
        except InputError:
            return None
        after = text[text.find(mark) + len(mark):] if mark in text else ""
        ids = self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        special = set(getattr(self.tokenizer, "all_special_ids", [])) | {
            i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)}
        return ids[0] if ids and ids[0] in special else None

    def prompt(self, messages: list[dict], where=None) -> tuple[str, str] | None:
        """(the text a model answers, the reference answer) for the last assistant turn."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return None
        return (self.text(messages[:last], add_generation_prompt=True, where=where),
                messages[last]["content"])

    def assistant_spans(self, messages: list[dict], where) -> tuple[str, list[tuple]]:
        """(the conversation's text, the character spans of its assistant turns); `where`
        names the row, as in messages_of."""
        text = self.text(messages, where=where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.text(messages[:i], add_generation_prompt=True, where=where) \
                if i else ""
            through = self.text(messages[:i + 1], where=where)
            if not (text.startswith(before) and text.startswith(through)
                    and len(through) > len(before)):
                raise InputError(f"{_named(where)}: the chat template renders the conversation "
                                 f"up to message {i + 1} as text that does not begin the whole "
                                 f"conversation's, so the assistant's tokens cannot be told "
                                 f"apart; use task.loss_on=all, or a template that renders "
                                 f"turns one after another (data.chat_template)")
            spans.append((len(before), len(through)))
        return text, spans


def bos_it_adds(tokenizer) -> int | None:
    """The id of the BOS token the tokenizer puts before a text by default, or None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def text_ids(tokenizer, text: str, bos_id: int | None = None) -> list[int]:
    """A rendered text's ids, after `bos_id` where there is one (Renderer.bos_id)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if bos_id is None else [bos_id, *ids]


def template_error(exc: Exception, where) -> InputError:
    """The chat template's own refusal (a raise_exception such as 'System role not supported')
    or its syntax error, as one message naming the row and the template's line."""
    line = getattr(exc, "lineno", None)
    at = f" (the template's line {line})" if line else ""
    row = f"{_named(where)}: " if where is not None else ""
    if type(exc).__name__ == "TemplateSyntaxError":
        return InputError(f"the chat template does not parse{at}: {exc}; fix it (data."
                          f"chat_template, or the tokenizer's chat_template)")
    return InputError(f"{row}the chat template refuses the conversation{at}: {exc}; change the "
                      f"row (or leave it out), or give another template with data.chat_template")


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The ids a generation stops at: the tokenizer's end of sequence, the model's
    generation_config's (an instruct model's end of turn: Llama 3's <|eot_id|>), and the token
    the chat template ends an assistant turn with (the one a fine-tuned model learnt to end
    its answers with)."""
    found = []
    given = getattr(generation_config, "eos_token_id", None)
    for value in (tokenizer.eos_token_id, *(given if isinstance(given, list) else [given]),
                  Renderer(tokenizer).turn_end_id()):
        if isinstance(value, int) and value not in found:
            found.append(value)
    return found


# --- tokens and labels -------------------------------------------------------------------------
@dataclass
class EncodeCounts:
    examples: int = 0
    truncated: int = 0
    dropped: int = 0  # no token left to learn from (after truncation, or no assistant turn)
    empty_answers: int = 0  # rows with an assistant turn of no text (it learns to say nothing)


def encode(tokenizer, text: str, spans: list[tuple], max_length: int, loss_on: str,
           bos_id: int | None = None) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, truncated): labels are the ids on the tokens the loss is on, else
    IGNORE; the text is cut at max_length tokens, its start kept; `bos_id` goes first."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if bos_id is not None:  # no characters of the text: never the assistant's
        ids, offsets = [bos_id, *ids], [(0, 0), *offsets]
    if loss_on == "all":
        labels = list(ids)
    else:
        labels = [t if any(a < end and b > start for start, end in spans) else IGNORE
                  for t, (a, b) in zip(ids, offsets)]
    truncated = len(ids) > max_length
    return ids[:max_length], labels[:max_length], truncated


def encode_rows(dataset, tokenizer, d, loss_on: str, split: str, counts: EncodeCounts):
    """The split as input_ids/labels/attention_mask rows; rows with no label are dropped."""
    form = row_form(dataset.column_names, d)
    renderer = Renderer(tokenizer)
    if not renderer.templated and split == "train":  # a base model's tokenizer: say so once
        log.info("%s", WITHOUT_TEMPLATE)
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(f"task=sft needs a fast (Rust) tokenizer, whose character offsets tell "
                         f"the assistant's tokens apart; {type(tokenizer).__name__} is not one")
    rows = {"input_ids": [], "labels": [], "attention_mask": []}
    place = row_place(split, dataset, d)
    for index, row in enumerate(dataset):
        where = lambda index=index: place(index)  # noqa: E731  (worked out for an error only)
        messages = messages_of(row, form, d, where)
        counts.empty_answers += any(m["role"] == "assistant" and not m["content"].strip()
                                    for m in messages)
        text, spans = (renderer.assistant_spans(messages, where) if loss_on == "response"
                       else (renderer.text(messages, where=where), []))
        ids, labels, truncated = encode(tokenizer, text, spans, d.max_seq_length, loss_on,
                                        renderer.bos_id)
        counts.examples += 1
        counts.truncated += truncated
        # a label at position 0 is never a target (the model predicts token i from those
        # before it), so a row needs one past it
        if all(label == IGNORE for label in labels[1:]):
            counts.dropped += 1
            continue
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["attention_mask"].append([1] * len(ids))
    from datasets import Dataset

    return Dataset.from_dict(rows)


def generation_prompts(dataset, tokenizer, d, limit: int) -> list[dict]:
    """[{prompt, reference}] for the first `limit` rows of a split that have an answer and a
    prompt shorter than data.max_seq_length (a longer one trains nothing either: its answer
    is cut off)."""
    if not limit:
        return []
    form = row_form(dataset.column_names, d)
    renderer = Renderer(tokenizer)
    found, too_long = [], 0
    place = row_place("validation", dataset, d)
    for index, row in enumerate(dataset):
        where = lambda index=index: place(index)  # noqa: E731
        pair = renderer.prompt(messages_of(row, form, d, where), where)
        if pair is None:
            continue
        if len(text_ids(tokenizer, pair[0], renderer.bos_id)) >= d.max_seq_length:
            too_long += 1
            continue
        found.append({"prompt": pair[0], "reference": pair[1]})
        if len(found) == limit:
            break
    if too_long:
        log.warning("task.sample_generations: %d validation prompts of data.max_seq_length=%d "
                    "tokens or more are not answered (training cuts their last answer off)",
                    too_long, d.max_seq_length)
    return found


# --- packing -----------------------------------------------------------------------------------
def pack(dataset, max_length: int):
    """Rows of several examples each, up to max_length tokens, filled best-fit decreasing
    (`best_fit_decreasing`): input_ids and labels concatenated, position_ids restarting at every
    example. Each example's first label is IGNORE: in a packed row it would be the target of the
    previous example's last token. An example longer than max_length (not cut) is a row alone."""
    from datasets import Dataset

    packed = {"input_ids": [], "labels": [], "position_ids": [], "num_examples": []}
    input_ids, labels = dataset["input_ids"], dataset["labels"]
    for members in best_fit_decreasing([len(ids) for ids in input_ids], max_length):
        row = {"input_ids": [], "labels": [], "position_ids": [], "num_examples": len(members)}
        for i in members:
            row["input_ids"] += input_ids[i]
            row["labels"] += [IGNORE] + labels[i][1:]
            row["position_ids"] += list(range(len(input_ids[i])))
        _append(packed, row)
    return Dataset.from_dict(packed)


# the line an unpacked SFT run logs (packing_hint), read back by accelerate=auto's measurement
# (tuning/measure.py): its packing candidate keeps the config's examples a step in fewer rows
PACKING_HINT = ("task=sft: data.packing=true would lay the {examples} training examples in "
                "{rows} rows of at most {length} tokens ({per_row:.2f} a row)")


def packing_hint(rows, max_length: int) -> str:
    """What data.packing=true would make of these encoded training rows (`PACKING_HINT`): the
    same bins as `pack`, from the rows' lengths alone (read from their Arrow column)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(rows.data.column("input_ids")).to_pylist()
    bins = len(best_fit_decreasing(lengths, max_length))
    return PACKING_HINT.format(examples=len(lengths), rows=bins, length=max_length,
                               per_row=len(lengths) / max(bins, 1))


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of at most `capacity` tokens: the examples, longest first, each into the fullest bin
    it still fits (a new one when none does). Filling rows in the data's order leaves the tail
    of each row empty (about a tenth of a 2048-token row on instruction-length chats, computed
    as padding); best-fit decreasing leaves almost nothing (TRL's and Megatron's packers do the
    same). Each bin lists its examples in the data's order; the bins come in the order they
    were opened (the training loader shuffles them); an example of no tokens is in none. O(n log
    capacity): a Fenwick tree counts the open bins by free space, to find the smallest free
    space >= a length."""
    free = _FreeSpaceCounts(capacity)
    open_bins: dict[int, list[int]] = {}  # free tokens -> bins with that much free, a stack
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n == 0:
            continue
        room = free.smallest_at_least(n) if n <= capacity else None
        if room is None:
            bins.append([i])
            b, left = len(bins) - 1, capacity - n
        else:
            b = open_bins[room].pop()
            free.remove(room)
            bins[b].append(i)
            left = room - n
        if left > 0:
            open_bins.setdefault(left, []).append(b)
            free.add(left)
    return [sorted(members) for members in bins]


class _FreeSpaceCounts:
    """How many open bins have each amount of free space (1..capacity), and the smallest amount
    >= n that one has: a Fenwick tree over the amounts."""

    def __init__(self, capacity: int):
        self.size = capacity
        self.tree = [0] * (capacity + 1)
        self.total = 0
        self.top = 1 << capacity.bit_length()

    def add(self, amount: int, count: int = 1) -> None:
        self.total += count
        while amount <= self.size:
            self.tree[amount] += count
            amount += amount & -amount

    def remove(self, amount: int) -> None:
        self.add(amount, -1)

    def _below(self, amount: int) -> int:  # bins with free space < amount
        count, i = 0, amount - 1
        while i > 0:
            count += self.tree[i]
            i -= i & -i
        return count

    def smallest_at_least(self, n: int) -> int | None:
        k = self._below(n) + 1  # the k-th bin in order of free space is the one wanted
        if k > self.total:
            return None
        pos, step = 0, self.top
        while step:
            nxt = pos + step
            if nxt <= self.size and self.tree[nxt] < k:
                pos, k = nxt, k - self.tree[nxt]
            step >>= 1
        return pos + 1


def _append(packed: dict, row: dict) -> None:
    for key, value in row.items():
        packed[key].append(value)


class PackedCollate:
    """Packed rows -> a batch without attention_mask (Hugging Face decoders then attend within
    each example only, from the restarting position_ids), padded to the rule's length; the
    padding is one more sequence of its own, with no label. The examples and real tokens it
    holds go to the loop's counts (data/counts.py), not to the model."""

    def __init__(self, pad_id: int, rule=None):
        self.pad_id, self.rule = pad_id, rule

    def __call__(self, features):
        import torch

        from rapidformer.data.lengths import target_length

        longest = max(len(f["input_ids"]) for f in features)
        length = target_length(longest, self.rule)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for f in features:
            pad = length - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE] * pad)
            batch["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
        out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        return with_counts(out, samples=sum(int(f["num_examples"]) for f in features),
                           tokens=sum(len(f["input_ids"]) for f in features),
                           slots=out["input_ids"].numel())
