"""What a run needs to be reproduced, next to its resolved config: `environment.json` with the
library versions, the project's git commit (and whether the checkout had local changes), the
seed and determinism setting, the machine and the command line."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("rapidformer", "torch", "transformers", "datasets", "tokenizers", "accelerate",
            "hydra-core", "omegaconf", "deepspeed", "megatron-core", "onnxruntime-training",
            "torchao", "liger-kernel", "peft", "bitsandbytes", "numpy")


def package_versions() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # rapidformer/, whose parent a checkout is


def git_state(folder: Path) -> dict:
    """The commit of the checkout the package runs from; nulls when it is not one (a wheel)."""
    def git(*args) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(folder), *args], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    # the package must be the checkout's own (a wheel inside another project's repository is not)
    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != folder.parent.resolve():
        return {"commit": None, "local_changes": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "local_changes": bool(status) if status is not None else None}


def write_environment(run_dir: str | Path, seed: int, deterministic: bool) -> Path:
    import torch

    record = {"versions": {**package_versions(), "python": platform.python_version()},
              "git": git_state(PACKAGE_DIR),
              "seed": seed, "deterministic": deterministic,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "gpus": [torch.cuda.get_device_name(i)
                                   for i in range(torch.cuda.device_count())]},
              "command": [Path(sys.argv[0]).name, *sys.argv[1:]]}
    path = Path(run_dir) / "environment.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
