"""The rows of a question-answering dataset, checked before any window is cut: a question, a
context, and answers that are where they say they are.

Answers are read in the hub's SQuAD layout, `{"text": [...], "answer_start": [...]}`, or as
SQuAD's own files hold them, a list of `{"text": ..., "answer_start": ...}` (made the former).
`answer_start` counts characters of the context from 0: an offset that does not find the
answer's text there (a byte offset, with any non-ASCII character before the answer, lands
elsewhere) would train every window on another span, so it is refused with its row. A question
without an answer (SQuAD v2's unanswerable ones) is refused too: the spans are chosen among the
context's, and no "no answer" is predicted yet.
"""
from __future__ import annotations

from rapidformer.config.schema import DataConfig
from rapidformer.data.text_classification import row_place
from rapidformer.errors import InputError

LAYOUT = ('{"text": [...], "answer_start": [...]} (the hub\'s squad) or a list of '
          '{"text": ..., "answer_start": ...} (SQuAD\'s own files)')


def checked_splits(splits: dict, d: DataConfig) -> dict:
    """Every split with its rows checked and its answers in the hub's layout."""
    out = {}
    for split, ds in splits.items():
        place = row_place(split, ds, d)
        answers = [_answers(a, q, c, d, lambda i=i: place(i))
                   for i, (q, c, a) in enumerate(zip(ds[d.question_column], ds[d.context_column],
                                                     ds[d.answers_column]))]
        # written anew in one layout, starts as ints (a column with one 35.0 is all floats)
        from rapidformer.data.local_files import remember, source_of

        source = source_of(ds)
        ds = ds.remove_columns(d.answers_column).add_column(d.answers_column, answers)
        remember(ds, source)
        out[split] = ds
    return out


def _answers(answers, question, context, d: DataConfig, place) -> dict:
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"{place()} has no question in column '{d.question_column}' "
                         f"(data.question_column); fill it in or drop the row")
    if not isinstance(context, str) or not context.strip():
        raise InputError(f"{place()} has no context in column '{d.context_column}' "
                         f"(data.context_column); fill it in or drop the row")
    if isinstance(answers, list) and all(isinstance(a, dict) for a in answers):
        answers = {"text": [a.get("text") for a in answers],
                   "answer_start": [a.get("answer_start") for a in answers]}
    if not isinstance(answers, dict) or not isinstance(answers.get("text"), list) or \
            not isinstance(answers.get("answer_start"), list) or \
            len(answers["text"]) != len(answers["answer_start"]):
        raise InputError(f"{place()} has answers in column '{d.answers_column}' "
                         f"(data.answers_column) that are not {LAYOUT}: {answers!r:.200}")
    if not answers["text"]:
        raise InputError(f"{place()} has no answer in column '{d.answers_column}' "
                         f"(data.answers_column): unanswerable questions (SQuAD v2) are not "
                         f"supported yet, since no 'no answer' is predicted; drop such rows")
    answers = {"text": list(answers["text"]), "answer_start": list(answers["answer_start"])}
    for i, (text, start) in enumerate(zip(answers["text"], answers["answer_start"])):
        if isinstance(start, float) and start.is_integer():
            start = answers["answer_start"][i] = int(start)
        if not isinstance(text, str) or not text or isinstance(start, bool) or \
                not isinstance(start, int) or start < 0:
            raise InputError(f"{place()} has the answer {text!r:.80} at answer_start="
                             f"{start!r}: an answer is a non-empty text and its start a whole "
                             f"number of characters; fix the row or drop it")
        found = context[start:start + len(text)]
        if found != text:
            at = context.find(text)
            hint = (f"; the text is at character {at}: answer_start counts characters of the "
                    f"context from 0, not bytes" if at >= 0 else
                    "; the text is nowhere in the context")
            raise InputError(f"{place()}: its answer {text!r:.80} is not at answer_start="
                             f"{start} of its context, which reads {found!r:.80} there{hint}; "
                             f"fix the row or drop it")
    return answers
