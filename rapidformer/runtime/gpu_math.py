"""cuBLAS/cuDNN switches a run sets on its GPU: TF32 matmuls and cuDNN autotuning."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig


def gpu_math_settings(cfg: RunConfig) -> dict:
    """cuBLAS/cuDNN switches for this run: TF32 (trainer.tf32; null: with mixed precision only)
    and cuDNN autotuning (off when the run must be deterministic)."""
    t = cfg.trainer
    tf32 = t.tf32 if t.tf32 is not None else cfg.precision.dtype != "fp32"
    return {"tf32": tf32, "cudnn_benchmark": not t.deterministic}


def apply_gpu_math_settings(cfg: RunConfig) -> None:
    settings = gpu_math_settings(cfg)
    torch.backends.cuda.matmul.allow_tf32 = settings["tf32"]
    torch.backends.cudnn.allow_tf32 = settings["tf32"]
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
