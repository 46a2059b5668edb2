"""Search results kept by what decides them, so that a second run skips the search.

The key is a hash of: every setting of the run but those that change only where it writes and
what it logs (IGNORED), the size and modification time of the files its data, model,
tokenizer and user script name on this machine, the number of ranks, the hardware (device kind
and name, how many) and the library versions (torch, transformers, rapidformer and the
optional accelerator libraries). A change in any of them searches again. One JSON file per key
under accelerate.cache_dir, else $RAPIDFORMER_TUNING_CACHE, else ~/.cache/rapidformer/tuning.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from rapidformer.config.schema import RunConfig

FORMAT = 2  # 2: every setting in the key, the files' state
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


# settings that change where a run writes and what it logs, not what a search measures or
# picks; every other setting is in the key (the learning rate, the seed, the optimizer, the
# scheduler, each precision and graph key, ...): a cached choice is never reused for a run
# that trains otherwise
IGNORED = {"trainer": ("output_dir", "resume", "overwrite", "progress_bar", "tensorboard",
                       "log_interval", "save_interval", "save_last", "keep_last", "export_hf",
                       "exit_interval", "dry_run", "profile_steps"),
           "accelerate": ("cache_dir", "cache", "budget_s"),
           # the rendezvous address and port (a cluster's per-job MASTER_ADDR/PORT): the
           # number of ranks is in the key apart
           "launcher": None,
           "logger": None}  # None: the whole section
LOCAL_KEYS = (("data", "path"), ("model", "name_or_path"), ("model", "tokenizer"),
              ("model", "merge_file"), ("model", "init_from_hf"))
MOST_ENTRIES = 1000  # a folder's files looked at, at most


def settings(cfg: RunConfig) -> dict:
    """The typed config as a dict, less what IGNORED names."""
    import dataclasses

    out = dataclasses.asdict(cfg)
    for section, keys in IGNORED.items():
        if keys is None:
            out.pop(section, None)
        else:
            for key in keys:
                out.get(section, {}).pop(key, None)
    return out


def local_state(value) -> list:
    """Size and modification time of the files a setting names on this machine (a file, a
    folder's files, a Megatron prefix's .bin/.idx): new data or weights at the same path search
    again. Empty for what is not here (a hub name)."""
    if not isinstance(value, str) or not value:
        return []
    path = Path(value).expanduser()
    found = []
    prefix = [path.with_name(path.name + ext) for ext in (".bin", ".idx")] if path.name else []
    for p in (path, *prefix):
        try:
            files = [p] if p.is_file() else sorted(p.iterdir())[:MOST_ENTRIES] if p.is_dir() \
                else []
            found += [(f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files
                      if f.is_file()]
        except OSError:
            continue
    return found


def key_fields(cfg: RunConfig, device_kind: str) -> dict:
    """What the result depends on."""
    from rapidformer.config.sizes import launched_world_size

    files = {f"{section}.{key}": local_state(getattr(getattr(cfg, section), key, None))
             for section, key in LOCAL_KEYS}
    files["user_script"] = local_state(cfg.user_script)
    return {"format": FORMAT, "settings": settings(cfg), "world": launched_world_size(cfg),
            "files": files, "hardware": hardware(device_kind), "versions": versions()}


def key_of(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load(directory: Path, key: str) -> tuple[dict | None, str]:
    """(the record for `key`, or None; why a file that is there was not used, or "")."""
    path = directory / f"{key}.json"
    if not path.exists():
        return None, ""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({exc})"
    choice = record.get("choice") if isinstance(record, dict) else None
    if not (isinstance(choice, dict) and isinstance(choice.get("label"), str)
            and isinstance(choice.get("overrides"), list)
            and all(isinstance(o, str) for o in choice["overrides"]) and record.get("key") == key):
        return None, f"{path} is not a search's record"
    return record, ""


def store(directory: Path, key: str, record: dict) -> tuple[Path | None, str]:
    """(the file, or None and why not): written whole or not at all (a temporary file
    renamed); a cache that cannot be written costs the next run a search, not this run."""
    path = directory / f"{key}.json"
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=2, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return None, f"{directory} cannot hold it ({exc})"
    return path, ""
