"""What the black-box fine-tuning tasks share: their data (local files, the hub, or the task's
generated data), a tokenizer that stays the same on resume, sums over ranks, and the rule for
the splits they evaluate.

The rule: a validation (or scored test) split the data has, but which the task's filtering or
tokenization leaves without one example, is an error naming the split, how many examples were
dropped and why, and the fix; a run must not train for hours and evaluate nothing. Data without
a validation split trains without evaluation, as the user chose: the Finetuner says so at the
start and records it in metrics.jsonl, which the end-of-run summary reads.

Metrics are sums over exactly the split's examples: each task adds a batch's counts only when
the batch is not padding (`self.padding_batch`: a rank whose share ran out evaluates a copy to
stay in step with the others' collectives), sums them over ranks, and divides once; a metric
of no example at all is NaN, not 0."""
from __future__ import annotations

import math

import torch

from rapidformer.data.synthetic_tasks import TASK_KINDS, writer_for
from rapidformer.data.text_classification import _load_splits_and_files, require_columns
from rapidformer.errors import InputError
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.tasks.batching import Batching, RightPadded
from rapidformer.templates.finetuner import Finetuner


class TaskFinetuner(Finetuner):
    # data.* keys of the columns this task reads
    columns: tuple[str, ...] = ()

    def load_splits(self) -> dict:
        task = self.cfg.task.name
        write = writer_for(task, self.cfg.data.synthetic_lengths) if task in TASK_KINDS \
            else None
        splits, self.split_files = _load_splits_and_files(
            self.cfg.data, self.engine.run_dir, **({"write_synthetic": write} if write else {}))
        require_columns(splits, {f"data.{key}": getattr(self.cfg.data, key)
                                 for key in self.columns}, self.split_files)
        self.scored_splits = tuple(s for s in splits if s != "train")
        return splits

    # --- the evaluated splits' rule (the module docstring) --------------------------------------
    def require_examples(self, encoded: dict, found: dict, why: str = "", fix: str = "") -> None:
        """Refuse an evaluated split (validation, or a scored test) that the task's filtering
        left empty. `encoded`: {split: what the task evaluates}; `found`: {split: the examples
        the data had}; `why` the examples were dropped and the `fix`, when the task drops some."""
        for split in ("validation", "test"):
            if split in encoded and encoded[split] is not None and len(encoded[split]) == 0 \
                    and split in getattr(self, "scored_splits", (split,)):
                raise self.empty_split(split, found.get(split, 0), why, fix)

    def empty_split(self, split: str, found: int, why: str = "", fix: str = "",
                    what: str | None = None) -> InputError:
        """The error for `split` left without an example to use: the data had `found`, all
        dropped (`why`; or `what` happened instead), and `fix`."""
        files = getattr(self, "split_files", {}) or {}
        where = str(files[split]) if split in files else f"data.path={self.cfg.data.path}"
        what = what or (f"all {found} of its examples were dropped ({why})" if found and why
                        else f"all {found} of its examples were dropped" if found
                        else "it has no example")
        if split == "train":
            return InputError(f"{where}: task={self.cfg.task.name} has nothing to train on in "
                              f"the train split: {what}. {fix or 'Add examples'}")
        without = "evaluation" if split == "validation" else "a test score"
        return InputError(f"{where}: task={self.cfg.task.name} has nothing to score in the "
                          f"{split} split: {what}. {fix + '; or ' if fix else ''}remove the "
                          f"{split} split from the data to train without {without}")

    def make_tokenizer(self, texts):
        """The run's tokenizer (`texts()` yields the training texts a new vocabulary is
        trained on, for a config-built model)."""
        saved = self._resumed_tokenizer_dir()
        self.tokenizer = build_tokenizer(self.cfg.model, texts,
                                         saved or self.engine.run_dir / "tokenizer",
                                         self.cfg.data.max_seq_length)
        return self.tokenizer

    def _resumed_tokenizer_dir(self):
        """On resume, the tokenizer saved with the checkpoint (a trained vocab must not change)."""
        path = self.engine.resume_checkpoint
        if path is not None and (path / "tokenizer" / "tokenizer_config.json").is_file():
            return path / "tokenizer"
        return None

    def shape_batches(self, collate, masked_lm: bool = False):
        """The evaluation collate around `collate` (the task's padding one); the training one
        becomes `self.train_collate_fn` (data.pad_to, trainer.unpad, task.mlm_head)."""
        self.batching = Batching(self.cfg, self.tokenizer, self.engine.transforms,
                                 masked_lm=masked_lm)
        self.train_collate_fn, evaluation = self.batching.collates(
            RightPadded(collate, self.tokenizer))
        return evaluation

    def sum_over_ranks(self, *values: float) -> list[float]:
        """Each value summed over every rank (a collective: every rank calls it)."""
        total = torch.tensor([float(v) for v in values], dtype=torch.float64,
                             device=self.engine.device)
        return self.engine.all_reduce_sum(total).tolist()

    def test_is_labelled(self, test_ds) -> bool:
        return "test" in getattr(self, "scored_splits", ())


def mean(total: float, count: float) -> float:
    """total / count, NaN for no count (a metric of nothing is no number, not 0)."""
    return total / count if count else math.nan
