"""Which verbs serve a finished run of which task: one table, asked by every verb that reads a
run's model before it loads anything, so that a verb given a run it does not serve refuses it
with the run's task and the verbs that do serve it (rather than loading a head the run never
trained and printing what its random weights make of the input)."""
from __future__ import annotations

from rapidformer.errors import InputError

FINE_TUNED = ("sequence_classification", "token_classification", "question_answering",
              "masked_lm", "seq2seq_lm")
SERVES = {
    "eval": (*FINE_TUNED, "sft"),
    "predict": FINE_TUNED,
    "generate": ("sft", "causal_lm"),
}
# why a verb leaves a task out, where the reason is not just "another kind of model"
WHY_NOT = {
    ("eval", "causal_lm"): "a pretraining run is scored by its own run: validation/ and test/ "
                           "loss and perplexity in RUN_DIR/metrics.jsonl",
    ("eval", "bert_pretraining"): "a pretraining run is scored by its own run: validation/ "
                                  "and test/ loss in RUN_DIR/metrics.jsonl",
    ("predict", "bert_pretraining"): "its heads are pretraining objectives (masked-LM and "
                                     "next sentence), no task head: fine-tune it (e.g. "
                                     "task=sequence_classification model=hf "
                                     "model.name_or_path=DIR of `rapidformer export`) and "
                                     "predict with that run",
}


def require_served(verb: str, task: str, run_dir) -> None:
    """Refuse (InputError, exit 2) a run of `task` that `verb` does not serve."""
    if task in SERVES[verb]:
        return
    others = [f"rapidformer {name}" for name, tasks in SERVES.items() if task in tasks]
    why = WHY_NOT.get((verb, task))
    raise InputError(
        f"rapidformer {verb} serves runs of task={', '.join(SERVES[verb])}; {run_dir} is a "
        f"task={task} run" + (f" ({why})" if why else "") + "; "
        + (f"use {' or '.join(others)} on it" if others else
           "no verb answers with its model: `rapidformer export RUN_DIR --to DIR` writes it as "
           "a Hugging Face model (a megatron run's is RUN_DIR/hf_model, written at its end)"))
