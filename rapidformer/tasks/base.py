"""What the black-box fine-tuning tasks share: their data (local files, the hub, or the task's
generated data), a tokenizer that stays the same on resume, and sums over ranks."""
from __future__ import annotations

import torch

from rapidformer.data.synthetic_tasks import TASK_KINDS, writer_for
from rapidformer.data.text_classification import load_splits, require_columns
from rapidformer.data.tokenizers import build_tokenizer
from rapidformer.tasks.batching import Batching
from rapidformer.templates.finetuner import Finetuner


class TaskFinetuner(Finetuner):
    # data.* keys of the columns this task reads
    columns: tuple[str, ...] = ()

    def load_splits(self) -> dict:
        task = self.cfg.task.name
        write = writer_for(task) if task in TASK_KINDS else None
        splits = load_splits(self.cfg.data, self.engine.run_dir,
                             **({"write_synthetic": write} if write else {}))
        require_columns(splits, {f"data.{key}": getattr(self.cfg.data, key)
                                 for key in self.columns})
        self.scored_splits = tuple(s for s in splits if s != "train")
        return splits

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
        self.train_collate_fn, evaluation = self.batching.collates(collate)
        return evaluation

    def sum_over_ranks(self, *values: float) -> list[float]:
        total = torch.tensor([float(v) for v in values], dtype=torch.float64,
                             device=self.engine.device)
        return self.engine.all_reduce_sum(total).tolist()

    def test_is_labelled(self, test_ds) -> bool:
        return "test" in getattr(self, "scored_splits", ())
