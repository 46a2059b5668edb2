"""Search results kept by what decides them, so that a second run skips the search.

The key is a hash of: every setting of the run but those that change only where it writes and
what it logs (IGNORED), which of them the command line pins (space.pins: a value given there
equal to the default is not searched over), the size and modification time of the files its
settings name on this machine (PATH_KEYS: data, model, tokenizer, chat template, user script; a
folder's subfolders included, not what runs write there; each prefix of a Megatron blend), the
number of ranks, the hardware (device kind and name, how many; a CPU's model, the cores this
process may use and torch's threads) and the library versions (torch, transformers, rapidformer and the optional
accelerator libraries), with a fingerprint of rapidformer's own source files (an editable
install keeps its version number however its code changes). A change in any of them searches
again. One JSON file per key under accelerate.cache_dir, else $RAPIDFORMER_TUNING_CACHE, else
$XDG_CACHE_HOME/rapidformer/tuning (~/.cache/rapidformer/tuning).

A search the budget cut short (candidates not measured) is kept with the budget it had: a run
given a larger accelerate.budget_s searches again (`outgrown`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

from rapidformer.config.schema import RunConfig

# 2: every setting in the key, the files' state; 3: PATH_KEYS, subfolders; 4: the pins, a
# blend's prefixes, the source fingerprint, the CPU's model and affinity; 5: torch's threads,
# and a choice made under a changing load is not kept (tuning/confirm.py)
FORMAT = 5
LIBRARIES = ("torch", "transformers", "rapidformer", "deepspeed", "liger_kernel", "torchao",
             "peft", "megatron-core", "flash_attn")


def cache_dir(cfg: RunConfig) -> Path:
    where = cfg.accelerate.cache_dir or os.environ.get("RAPIDFORMER_TUNING_CACHE")
    if where:
        return Path(where).expanduser()
    # the XDG base directory spec: a relative $XDG_CACHE_HOME is invalid and ignored
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    home = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return home / "rapidformer" / "tuning"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["rapidformer-source"] = source_fingerprint()
    return out


@functools.lru_cache(maxsize=None)
def source_fingerprint() -> str:
    """The names, sizes and modification times of rapidformer's own .py files, hashed (a few
    milliseconds): an editable install's version stays 0.1.0 while its code changes."""
    import rapidformer

    return folder_fingerprint(Path(rapidformer.__file__).parent)


def folder_fingerprint(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        with contextlib.suppress(OSError):
            st = path.stat()
            digest.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo's, on Linux), else None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    return None


def hardware(device_kind: str) -> dict:
    import platform

    import torch

    if device_kind == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0),
                "count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    # the cores this process may use (taskset, a container's cpuset), not only the machine's,
    # and the threads torch computes with (OMP_NUM_THREADS): the children inherit both
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"kind": "cpu", "name": platform.processor() or platform.machine(),
            "model": cpu_model(), "count": os.cpu_count(), "usable": usable,
            "threads": torch.get_num_threads()}


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
# the settings that name files on this machine (a hub name is not here: nothing to read);
# tests/test_tuning.py checks that every path-like key of the schema is listed
PATH_KEYS = ("data.path", "data.train_file", "data.validation_file", "data.test_file",
             "data.chat_template", "model.name_or_path", "model.tokenizer", "model.merge_file",
             "model.init_from_hf", "user_script")
MOST_ENTRIES = 1000  # a folder's files looked at, at most
# folders that runs and their loggers write (a run's own, MLflow's and W&B's stores), never
# data: a data folder that holds earlier runs (data.path=.) keeps its key
NOT_DATA = ("mlruns", "wandb", "__pycache__")


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


def local_state(value, skip: tuple[Path, ...] = ()) -> list:
    """Size and modification time of the files a setting names on this machine (a file, the
    files of a folder and its subfolders, a Megatron prefix's .bin/.idx): new data or weights
    at the same path search again. Empty for what is not here (a hub name). Hidden folders and
    `skip` (the run's own output and the cache: what a run writes) are not looked into."""
    if not isinstance(value, (str, Path)) or not str(value) or "\n" in str(value):
        return []
    path = Path(value).expanduser()
    parts = str(value).split()
    if len(parts) > 1 and not _exists(path):  # a Megatron blend: "0.7 prefixA 0.3 prefixB"
        return [(part, *state) for part in parts if not _number(part)
                for state in local_state(part, skip)]
    found = []
    prefix = [path.with_name(path.name + ext) for ext in (".bin", ".idx")] if path.name else []
    for p in (path, *prefix):
        try:
            if p.is_file():
                found.append((p.name, *_stat(p)))
            elif p.is_dir():
                found += _folder_state(p, skip)
        except (OSError, ValueError):  # a name too long for a path, a null byte
            continue
    return found


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _folder_state(folder: Path, skip: tuple[Path, ...]) -> list:
    from rapidformer.checkpoint.run_dir import RUN_MARKER

    skipped = {s.resolve() for s in skip}
    seen = {folder.resolve()}  # followed links: each folder once (a link to a parent loops)
    found = []
    # links followed: a data folder of linked shards changes when they do
    for visited, (root, dirs, files) in enumerate(os.walk(folder, followlinks=True)):
        if visited >= MOST_ENTRIES:  # a tree of empty folders
            break
        here = Path(root)
        kept = []
        for d in sorted(dirs):
            real = (here / d).resolve()
            if d.startswith(".") or d in NOT_DATA or real in skipped or real in seen or \
                    (here / d / RUN_MARKER).exists():  # a run's folder: what runs write
                continue
            seen.add(real)
            kept.append(d)
        dirs[:] = kept
        for name in sorted(files):
            if len(found) >= MOST_ENTRIES:
                return found
            with contextlib.suppress(OSError):
                found.append((str((here / name).relative_to(folder)), *_stat(here / name)))
    return found


def named_files(cfg: RunConfig) -> dict:
    """The state of the files each of PATH_KEYS names (a data.* file name also under
    data.path), less the run's own output and the cache."""
    skip = tuple(Path(p).expanduser() for p in (cfg.trainer.output_dir, cache_dir(cfg)) if p)
    data_root = Path(cfg.data.path).expanduser() if cfg.data.path else None
    out = {}
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if not value or (cfg.data.source == "synthetic" and key == "data.path"):
            continue  # synthetic data: generated from the settings (in the key) by a run
        state = local_state(value, skip)
        if not state and section == "data" and data_root and not Path(value).is_absolute():
            state = local_state(data_root / value, skip)
        if state:
            out[key] = state
    return out


def key_fields(cfg: RunConfig, device_kind: str, pinned: list[str] = ()) -> dict:
    """What the result depends on; `pinned`: the keys the command line pins that a candidate
    would set (space.touched_pins)."""
    from rapidformer.config.sizes import launched_world_size

    return {"format": FORMAT, "settings": settings(cfg), "pinned": sorted(pinned),
            "world": launched_world_size(cfg), "files": named_files(cfg),
            "hardware": hardware(device_kind), "versions": versions()}


def outgrown(record: dict, budget_s: float) -> str:
    """Why a cached search is not this run's result, or "": the budget cut it short (it left
    candidates unmeasured) and this run's accelerate.budget_s is larger than the one that did
    (a cut by accelerate.max_fraction, in the key, is the same cut again)."""
    cut = record.get("truncated")
    if not isinstance(cut, dict) or cut.get("by") != "accelerate.budget_s":
        return ""
    before = cut.get("budget_s")
    if not isinstance(before, (int, float)) or budget_s <= before:
        return ""
    return (f"the cached search was cut short by accelerate.budget_s={before:g} (candidates not "
            f"measured); this run's {budget_s:g} may measure them")


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
