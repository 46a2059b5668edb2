"""The templates users subclass: Finetuner (and PreTrainer, with pretraining support)."""
from rapidformer.templates.finetuner import Finetuner
from rapidformer.templates.pretrainer import PreTrainer

__all__ = ["Finetuner", "PreTrainer"]
