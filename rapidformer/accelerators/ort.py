"""graph=ort: ONNX Runtime training (the seed's --onnx-runtime-training).

ORTModule exports the model to ONNX on its first step and runs forward and backward in ONNX
Runtime's graph executor. onnxruntime-training 1.19.2 is its last release: it trains with torch
2.4-2.6 and fails with torch >= 2.7, so it lives in its own environment (README: "graph=ort").
It needs two small C++ extensions compiled against the installed torch; its own installer also
compiles CUDA ones and fails where there is no CUDA toolkit, so `build_extensions` compiles only
the CPU ones — on first use, or ahead with `python -m rapidformer.accelerators.ort`.

ORTModule's default policy falls back to PyTorch, silently, on anything it cannot export; here
the fallback is off (unless the user sets ORTMODULE_FALLBACK_POLICY), so graph=ort either runs
in ONNX Runtime or stops with its error.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from rapidformer.accelerators.ddp import DDPStrategy
from rapidformer.errors import EXIT_NOT_AVAILABLE, NotAvailableError, Problem, caught

log = logging.getLogger("rapidformer")

TORCH_RANGE = ((2, 4), (2, 6))  # the torch releases onnxruntime-training 1.19.2 trains with
INSTALL = ('python3 -m venv .venv-ort && . .venv-ort/bin/activate && pip install torch==2.6.0 && '
           'pip install -e ".[ort]"')


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def extensions_dir() -> Path:
    """ORTModule's folder for its compiled extensions (found without importing ORTModule,
    whose import records that they are missing)."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise NotAvailableError(
            f"graph=ort needs onnxruntime-training, which is not installed; in an environment "
            f"with torch 2.4-2.6: {INSTALL}")
    folder = Path(list(spec.submodule_search_locations)[0]) / "training" / "ortmodule"
    if not folder.is_dir():
        raise NotAvailableError(
            "graph=ort needs onnxruntime-training, but the installed onnxruntime is the "
            "inference-only package; pip uninstall onnxruntime, then pip install "
            "'rapidformer[ort]'")
    return folder / "torch_cpp_extensions"


def check_available() -> None:
    """Refuse, before any work, a torch or an onnxruntime that graph=ort cannot run with."""
    low, high = TORCH_RANGE
    if not low <= torch_version() <= high:
        raise NotAvailableError(
            f"graph=ort: onnxruntime-training's last release (1.19.2) trains only with torch "
            f"2.4-2.6 (this environment: torch {torch.__version__}); use graph=compile or "
            f"graph=eager here, or run graph=ort from its own environment: {INSTALL}")
    extensions_dir()


def extensions_built(folder: Path) -> bool:
    return bool(glob.glob(str(folder / "*.so")) + glob.glob(str(folder / "*.dylib")))


def build_extensions(folder: Path | None = None) -> None:
    """Compile ORTModule's CPU extensions against this torch and put them where it looks."""
    folder = folder or extensions_dir()
    setups = sorted(glob.glob(str(folder / "cpu" / "*" / "setup.py")))
    if not setups:
        raise NotAvailableError(f"graph=ort: no extension sources under {folder / 'cpu'}; "
                                f"reinstall onnxruntime-training==1.19.2")
    log.info("graph=ort: compiling ONNX Runtime's %d CPU extensions for torch %s (once; about "
             "90 s on 2 cores)", len(setups), torch.__version__)
    env = {**os.environ, "ONNXRUNTIME_CUDA_VERSION": "", "ONNXRUNTIME_ROCM_VERSION": ""}
    # side by side, each in its own build folder (torch compiles each one's sources in
    # parallel too when ninja is installed, as the ort extra does)
    builds = {}
    for setup in setups:
        name = Path(setup).parent.name
        builds[name] = subprocess.Popen(
            [sys.executable, setup, "build", "--build-base", str(folder / "build" / name)],
            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, build in builds.items():
        output = build.communicate()[0]
        if build.returncode != 0:
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise NotAvailableError(f"graph=ort: compiling {name} failed "
                                    f"(it needs a C++ compiler and the Python headers):\n{tail}")
    for library in glob.glob(str(folder / "build" / "*" / "lib.*" / "*.so")):
        shutil.copy(library, folder / Path(library).name)
    log.info("graph=ort: extensions installed in %s", folder)


def ensure_extensions() -> None:
    """Build on first use; with several processes the first to take the lock builds while the
    others wait on it, so no process imports half-written libraries."""
    from filelock import FileLock

    folder = extensions_dir()
    if extensions_built(folder):
        return
    with FileLock(str(folder / ".rapidformer-build.lock")):
        if not extensions_built(folder):
            build_extensions(folder)


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """ORTModule around the model (inside DDP, which then sees ORT's parameters)."""
    check_available()
    ensure_extensions()
    os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    from onnxruntime.training.ortmodule import ORTModule

    log.info("graph=ort: ORTModule wraps the model (ONNX export on the first step; no fallback "
             "to PyTorch)")
    return ORTModule(model)


def is_ort_module(model: torch.nn.Module) -> bool:
    return type(model).__name__ == "ORTModule" and hasattr(model, "module")



class OrtStrategy(DDPStrategy):
    """graph=ort: ORTModule inside DDP (which then sees ORT's parameters); the rest, checkpoints
    included, is the DDP strategy's."""

    name = "ort"
    training_sdpa = False  # the ONNX export would bake its mask decision in

    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        if cfg.precision.name == "fp32":
            return []
        return [f"graph=ort with precision={cfg.precision.name}: not combined here. graph=ort "
                f"runs on the CPU only (onnxruntime-training 1.19.2 with torch 2.4-2.6), whose "
                f"ONNX Runtime training kernels are fp32, and the model's export to ONNX fails "
                f"under autocast; use precision=fp32 with graph=ort, or graph=compile with "
                f"precision={cfg.precision.name} (docs/seed_flags.md)"]

    @classmethod
    def environment_problems(cls, cfg, device: torch.device) -> list[Problem]:
        problems = caught(check_available)
        if device.type == "cuda":
            problems.append(Problem(
                "graph=ort on a GPU is not built: onnxruntime-training 1.19.2 was checked here "
                "on the CPU only (fp32); set trainer.device=cpu, or use graph=compile on the GPU",
                EXIT_NOT_AVAILABLE))
        return problems

    def inner_graph(self, model):
        return wrap(model)

    def unwrap(self, model):
        model = super().unwrap(model)
        return model.module if is_ort_module(model) else model


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check_available()
    build_extensions()
