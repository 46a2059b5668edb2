"""Search results kept by what decides them, so that a second run skips the search.

The key is a hash of: the model's shape (its config section: name, source, path, sizes), the
data's shape (its section: source, path, lengths, padding, packing) and the task, the batch
(micro and global batch, ranks), the search's own settings, the hardware (device kind and
name, how many) and the library versions (torch, transformers, rapidformer and the optional
accelerator libraries). A change in any of them searches again. One JSON file per key under
accelerate.cache_dir, else $RAPIDFORMER_TUNING_CACHE, else ~/.cache/rapidformer/tuning.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rapidformer.config.schema import RunConfig

FORMAT = 1
LIBRARIES = ("torch", "transformers", "rapidformer", "deepspeed", "liger_kernel", "torchao",
             "peft", "megatron-core", "flash_attn")


def cache_dir(cfg: RunConfig) -> Path:
    where = cfg.accelerate.cache_dir or os.environ.get("RAPIDFORMER_TUNING_CACHE")
    return Path(where).expanduser() if where else \
        Path.home() / ".cache" / "rapidformer" / "tuning"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def hardware(device_kind: str) -> dict:
    import platform

    import torch

    if device_kind == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0),
                "count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(),
            "count": os.cpu_count()}


def key_fields(cfg: RunConfig, plain: dict, device_kind: str) -> dict:
    """What the result depends on (plain: the settled config as a dict)."""
    from rapidformer.config.sizes import launched_world_size

    search = {k: v for k, v in plain["accelerate"].items() if k not in ("cache_dir", "cache",
                                                                     "budget_s")}
    return {"format": FORMAT, "task": plain["task"], "model": plain["model"],
            "data": plain["data"], "precision": plain["precision"]["name"],
            "graph": plain["graph"], "kernels": plain["kernels"]["name"],
            "memory": plain["memory"], "peft": plain["peft"], "parallelism": plain["parallelism"],
            "batch": {"micro": cfg.trainer.micro_batch_size,
                      "global": cfg.trainer.global_batch_size,
                      "unpad": cfg.trainer.unpad,
                      "checkpoint_activations": cfg.trainer.checkpoint_activations,
                      "offload_activations": cfg.trainer.offload_activations,
                      "recompute_granularity": cfg.trainer.recompute_granularity,
                      "world": launched_world_size(cfg)},
            # the choice is by time to result for the run's length: another length, another
            # search
            "length": {"train_iters": cfg.trainer.train_iters, "epochs": cfg.trainer.epochs},
            "search": search, "hardware": hardware(device_kind), "versions": versions()}


def key_of(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load(directory: Path, key: str) -> dict | None:
    path = directory / f"{key}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def store(directory: Path, key: str, record: dict) -> Path:
    """Written whole or not at all (a temporary file renamed)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.json"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, path)
    return path
