"""`rapidformer env`: what this machine has, and which accelerators can run here.

    rapidformer env            # a table
    rapidformer env --json     # the same as JSON (for bug reports and scripts)
"""
from __future__ import annotations

import importlib.util
import json
import platform
import shutil

from rapidformer.observability.run_record import package_versions

EXTRA_PACKAGES = ("wandb", "mlflow-skinny", "hydra-submitit-launcher", "hydra-optuna-sweeper",
                  "mkdocs", "matplotlib")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def devices() -> dict:
    import torch

    info = {"cuda": torch.cuda.is_available(), "cuda_version": torch.version.cuda,
            "gpus": [], "nccl": None, "gloo": torch.distributed.is_gloo_available()}
    if info["cuda"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": props.name,
                                 "memory_gb": round(props.total_memory / 2**30, 1),
                                 "capability": f"{props.major}.{props.minor}"})
        if torch.distributed.is_nccl_available():
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def accelerators(dev: dict, versions: dict) -> list[tuple[str, str, bool, str]]:
    """(setting, what it needs, available here, why not)."""
    import torch

    from rapidformer.accelerators.ort import TORCH_RANGE

    gpu = bool(dev["gpus"])
    bf16_gpu = gpu and torch.cuda.is_bf16_supported()
    torch_version = torch.__version__.split("+")[0]
    ort_ok = versions.get("onnxruntime-training") is not None and TORCH_RANGE[0] <= \
        tuple(int(x) for x in torch_version.split(".")[:2]) <= TORCH_RANGE[1]
    rows = [
        ("precision=bf16", "a CPU, or a GPU with bf16 (Ampere or newer)", not gpu or bf16_gpu,
         "this GPU has no bf16"),
        ("precision=fp16", "autocast + GradScaler (CPU or GPU); with ZeRO a GPU", True, ""),
        ("precision=fp8", "torchao 0.18 and a GPU with float8 (compute capability 8.9+)",
         versions.get("torchao") is not None and gpu
         and torch.cuda.get_device_capability() >= (8, 9),
         "pip install 'rapidformer[fp8]'" if versions.get("torchao") is None
         else "no GPU with float8 tensor cores here"),
        ("kernels=liger", "liger-kernel 0.8 and a CUDA GPU",
         versions.get("liger-kernel") is not None and gpu,
         "pip install 'rapidformer[liger]'" if versions.get("liger-kernel") is None
         else "no CUDA GPU here"),
        ("peft=lora", "peft 0.21", versions.get("peft") is not None,
         "pip install 'rapidformer[peft]'"),
        ("peft=qlora", "peft 0.21, bitsandbytes and a CUDA GPU",
         versions.get("peft") is not None and versions.get("bitsandbytes") is not None and gpu,
         "pip install 'rapidformer[qlora]'" if versions.get("bitsandbytes") is None
         or versions.get("peft") is None else "no CUDA GPU here"),
        ("memory=zero1/2/3", "deepspeed 0.19", versions.get("deepspeed") is not None,
         "pip install 'rapidformer[deepspeed]'"),
        ("memory=fsdp", "torch >= 2.6 (FSDP2)", _has("torch.distributed.fsdp"), ""),
        ("model=megatron_*, parallelism=tp2/pp2, data=megatron", "megatron-core 0.16",
         versions.get("megatron-core") is not None, "pip install 'rapidformer[megatron]'"),
        ("graph=compile", "torch.compile; on a CPU a C++ compiler",
         gpu or shutil.which("c++") is not None or shutil.which("g++") is not None,
         "no C++ compiler on PATH"),
        ("graph=ort", "onnxruntime-training 1.19.2 with torch 2.4-2.6, in its own environment",
         ort_ok, f"torch {torch_version} here" if versions.get("onnxruntime-training")
         else "pip install 'rapidformer[ort]' in a torch 2.6 environment"),
        ("several processes (launcher.nproc_per_node)", "gloo (CPU) or NCCL (GPU)",
         dev["gloo"] or dev["nccl"] is not None, "torch.distributed has no backend"),
        ("logger=wandb", "wandb", _has("wandb"), "pip install 'rapidformer[wandb]'"),
        ("logger=mlflow", "mlflow-skinny, sqlalchemy", _has("mlflow") and _has("sqlalchemy"),
         "pip install 'rapidformer[mlflow]'"),
        ("launcher=slurm", "hydra-submitit-launcher", _has("hydra_plugins.hydra_submitit_launcher"),
         "pip install 'rapidformer[slurm]'"),
        ("+recipe=quickstart_optuna (Optuna sweeps)", "hydra-optuna-sweeper",
         _has("hydra_plugins.hydra_optuna_sweeper"), "pip install 'rapidformer[optuna]'"),
    ]
    return [(name, needs, bool(ok), "" if ok else why) for name, needs, ok, why in rows]


def environment() -> dict:
    from importlib import metadata

    versions = {**package_versions(), "python": platform.python_version()}
    for name in EXTRA_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    dev = devices()
    return {"versions": versions, "devices": dev, "platform": platform.platform(),
            "accelerators": [dict(zip(("setting", "needs", "available", "missing"), row))
                             for row in accelerators(dev, versions)]}


def env_command(argv: list[str]) -> int:
    info = environment()
    if "--json" in argv:
        print(json.dumps(info, indent=1))
        return 0
    print("versions:")
    for name, version in info["versions"].items():
        print(f"  {name:<24} {version or '-'}")
    dev = info["devices"]
    print(f"\nplatform: {info['platform']}")
    gpus = ", ".join(f"{g['name']} ({g['memory_gb']} GB, sm {g['capability']})"
                     for g in dev["gpus"]) or "none"
    print(f"GPUs: {gpus}; CUDA {dev['cuda_version'] or '-'}; NCCL {dev['nccl'] or '-'}; "
          f"gloo {'yes' if dev['gloo'] else 'no'}")
    print("\n| setting | needs | here |\n|---|---|---|")
    for row in info["accelerators"]:
        here = "yes" if row["available"] else f"no: {row['missing']}"
        print(f"| {row['setting']} | {row['needs']} | {here} |")
    return 0
