"""peft=lora / qlora: low-rank adapters (peft's LoRA) on a Hugging Face model, its base frozen.

The transform attaches them before the model moves to its device and before any strategy wraps
it (`attach`): the targets are the attention and MLP projections of the model's family unless
peft.target_modules names them; a classification or QA head trains in full (peft's task types
keep it in modules_to_save), as do peft.modules_to_save. With qlora the linear layers of the
transformer blocks become bitsandbytes 4-bit layers first; they quantize as they move to the
GPU, so the full-precision base never sits in GPU memory (it is read on the CPU as the model
builder loaded it).

What the rest of the run sees, through the transform's protocol: checkpoints hold the trainable
parameters (adapters and fully trained modules) and their optimizer state only (its state
filter); a checkpoint records the adapters' settings, peft's adapter_config.json, the base
model's config and a fingerprint of the frozen base, and a resume on another base is refused. A
base that no file holds (built from the config, its weights random) is written once to
RUN_DIR/peft_base, so that the checkpoints stay exportable. The run's export merges the
adapters into a copy of the base (a plain Hugging Face model, no peft needed to load it);
`rapidformer export --adapter-only` writes peft's own adapter directory from a checkpoint
(transforms/lora_weights.py).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rapidformer.errors import EXIT_NOT_AVAILABLE, ConfigError, Problem
from rapidformer.transforms.base import ApplyContext, ModelTransform, StateFilter
from rapidformer.runtime.packages import installed
from rapidformer.transforms.lora_layers import (BNB_INSTALL, INSTALL, base_fingerprint,
                                                check_names, frozen_base_dtype,
                                                hold_frozen_base, import_peft, in_modules,
                                                linear_layer_names, lora_config, module_names,
                                                quantize_blocks, target_modules, task_type,
                                                trained_in_full)
from rapidformer.transforms.lora_weights import (BASE_CONFIG, FILES_DIR, check_loaded, fp32_copy,
                                                 full_precision_state, merge, merged_weights,
                                                 trainable_state)

if TYPE_CHECKING:
    from rapidformer.config.schema import RunConfig

log = logging.getLogger("rapidformer")

# in the run directory: the frozen base of a model built from its config (save_pretrained), and
# the fingerprint it was written with
BASE_COPY = "peft_base"
BASE_COPY_FINGERPRINT = "rapidformer_fingerprint.txt"
# the settings a resume must keep (the record's keys compared, in this order)
RESUMED_SETTINGS = ("method", "r", "alpha", "target_modules", "modules_trained_in_full",
                    "quant_type")


@dataclass
class Adapters:
    """What a run's adapters are, for its checkpoints, resume checks and export."""
    method: str
    config: object  # peft.LoraConfig
    base_class: str
    base_config: object  # the base's transformers config, as built
    base_name_or_path: str | None  # where the base's weights can be read again (None: nowhere)
    base_copy: str | None  # or: the run directory's copy of them (BASE_COPY)
    full: list[str]  # modules trained in full
    fingerprint: str
    trainable: int
    total: int
    model_state_bytes: int
    base_bytes: int
    quant_type: str | None = None  # qlora's 4-bit data type

    def record(self) -> dict:
        """What state.json records (`resume_problem` compares it)."""
        c = self.config
        return {"method": self.method, "r": c.r, "alpha": c.lora_alpha,
                "target_modules": sorted(c.target_modules),
                "modules_trained_in_full": list(self.full), "quant_type": self.quant_type,
                "base_class": self.base_class, "base_name_or_path": self.base_name_or_path,
                "base_copy": self.base_copy,
                "base_fingerprint": self.fingerprint, "trainable_parameters": self.trainable,
                "total_parameters": self.total}

    def write(self, directory: Path) -> None:
        """peft's adapter_config.json and the base's config into a checkpoint directory."""
        folder = directory / FILES_DIR
        folder.mkdir(exist_ok=True)
        self.config.save_pretrained(str(folder))
        if self.base_config is not None:  # a Hugging Face model's (what exports rebuild)
            self.base_config.to_json_file(str(folder / BASE_CONFIG))

    def log_checkpoint(self) -> None:
        log.info("checkpoint model state: %s (%s trainable parameters: the adapters and the "
                 "modules trained in full); the frozen base's %s is not saved",
                 _mib(self.model_state_bytes), f"{self.trainable:,}", _mib(self.base_bytes))

    @property
    def flops_parameters(self) -> float:
        """The parameter count whose 6N per token is the step's FLOPs: a frozen weight costs
        its forward and its input gradient (4 of the 6), not its weight gradient."""
        return self.trainable + (self.total - self.trainable) * 4 / 6

    def merged(self, model: nn.Module, state: dict | None) -> nn.Module | None:
        """A plain Hugging Face model: the base with the adapters merged in, on the CPU in
        fp32, built from `state` (the peft model's whole state dict, as the strategy gathered
        it; None: the live model's own). The live model is left as it is."""
        from transformers import PreTrainedModel

        if not isinstance(model.get_base_model(), PreTrainedModel):
            log.info("the base model is not a Hugging Face model: no hf_model export")
            return None
        state = full_precision_state(model) if state is None else fp32_copy(state)
        return merge(type(model.get_base_model()), self.base_config, self.config, state,
                     dict(model.named_buffers()))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def keep_base(model: nn.Module, fingerprint: str, run_dir: Path) -> None:
    """The frozen base's weights into RUN_DIR/peft_base, written whole or not at all, once: a
    copy there is this base's, or the one of the checkpoints a resume reads (trainer.overwrite
    removes it). Another base's copy stays as it is: the resume's fingerprint check refuses the
    run next, and those checkpoints export from it."""
    import shutil

    final, tmp = run_dir / BASE_COPY, run_dir / f".tmp-{BASE_COPY}"
    if (final / BASE_COPY_FINGERPRINT).is_file():
        return
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    (tmp / BASE_COPY_FINGERPRINT).write_text(fingerprint)
    tmp.rename(final)
    log.info("peft: the base model is built from its config (no file holds its weights): "
             "written once to %s, for exports of the adapter checkpoints", final)


def attach(model: nn.Module, cfg: RunConfig, run_dir: Path | None = None
           ) -> tuple[nn.Module, Adapters]:
    """The peft model of `model` (on the device it came on) and what its adapters are.
    `run_dir`: where rank 0 keeps a copy of a base that no file holds (None: other ranks)."""
    peft = import_peft()
    p = cfg.peft
    if isinstance(model, peft.PeftModel):
        raise ConfigError([f"peft={p.name}: the model is a peft model already; pass its base "
                           f"model (peft.PeftModel.get_base_model()), or use peft=none to train "
                           f"the adapters it has"])
    targets = target_modules(model, p)
    check_names(model, targets, "peft.target_modules", linear_layer_names(model))
    check_names(model, list(p.modules_to_save or []), "peft.modules_to_save", module_names(model))
    task = task_type(model)
    full = trained_in_full(model, p, task)
    config = lora_config(model, p, targets, task)
    fingerprint = base_fingerprint(model, full)
    base_bytes = sum(t.numel() * t.element_size() for n, t in model.named_parameters()
                     if not in_modules(n, full))
    base_config = copy.deepcopy(model.config) if hasattr(model, "config") else None
    source = cfg.model.name_or_path if cfg.model.source == "pretrained" else None
    copied = source is None and hasattr(model, "save_pretrained")
    if copied and run_dir is not None:
        keep_base(model, fingerprint, run_dir)
    if p.name == "qlora":
        quantize_blocks(model, p, cfg.precision.dtype)
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as exc:  # a target of a kind LoRA cannot adapt, in peft's words
        raise ConfigError([f"peft.target_modules={targets}: {exc}"]) from exc
    held = hold_frozen_base(model, frozen_base_dtype(model, p, cfg.precision.dtype))
    if p.fused:
        from rapidformer.transforms.lora_fused import fused_layers

        fused = fused_layers(model)
        if not fused:
            raise ConfigError([f"peft.fused=true: none of the adapted layers ({', '.join(targets)}) "
                               f"is a torch.nn.Linear or bitsandbytes 4-bit layer, which the "
                               f"fused function covers; set peft.fused=false"])
        log.info("peft.fused: %d adapted layers train through one function each (the input "
                 "saved once, the dropout mask drawn again in the backward); evaluation takes "
                 "peft's own path", fused)
    trainable, total = model.get_nb_trainable_parameters()
    model_state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()
                            if t.requires_grad)
    log.info("peft=%s: %s of %s parameters train (%.2f%%): r=%d adapters on %s%s; the frozen "
             "base is held in %s", p.name, f"{trainable:,}", f"{total:,}",
             100 * trainable / max(total, 1), p.r, ", ".join(targets),
             f"; in full: {', '.join(full)}" if full else "", held)
    adapters = Adapters(p.name, model.peft_config["default"], type(model.get_base_model()).__name__,
                        base_config, source, BASE_COPY if copied else None, full, fingerprint,
                        trainable, total,
                        model_state_bytes, base_bytes,
                        quant_type=p.quant_type if p.name == "qlora" else None)
    return model, adapters




class TrainableOnly(StateFilter):
    """A checkpoint of the parameters that train: the adapters and the modules trained in
    full, never the frozen base."""

    saves_frozen = False

    def state_dict(self, model: nn.Module) -> dict:
        return trainable_state(model)

    def loaded(self, model: nn.Module, missing: list[str], unexpected: list[str], where) -> None:
        check_loaded(model, missing, unexpected, where)

    def frozen_state(self, model: nn.Module) -> dict:
        return full_precision_state(model)


class LoRA(ModelTransform):
    """peft=lora/qlora (the record's `method` says which)."""

    name = "lora"
    before_move = True  # qlora's 4-bit layers quantize as the engine moves the model

    @classmethod
    def wanted(cls, cfg: RunConfig) -> bool:
        return cfg.peft.name != "none"

    @classmethod
    def settings(cls, cfg: RunConfig) -> list[str]:
        return [f"peft={cfg.peft.name}"]

    @classmethod
    def config_problems(cls, cfg: RunConfig) -> list[str]:
        """peft's adapters on Hugging Face models trained by torch, DeepSpeed or FSDP2;
        qlora's 4-bit base on one CUDA GPU per replica. (A key of an option not picked is
        refused where it is typed, config/compose.py: a recipe's own peft.r stays quiet when
        the command picks peft=none.)"""
        pe, m, p = cfg.peft, cfg.model, []
        what = f"peft={pe.name}"
        if pe.name == "none":
            return p
        if pe.target_modules is not None and not pe.target_modules:
            p.append("peft.target_modules=[] names no layer to adapt; name some (e.g. "
                     "peft.target_modules=[q_proj,v_proj]) or set it to null for the model "
                     "family's attention and MLP projections")
        if m.is_megatron:
            p.append(f"{what} with model={m.name}: peft's adapters wrap Hugging Face "
                     f"(torch.nn.Linear) layers, not megatron-core's tensor-parallel ones; use "
                     f"model=hf model.name_or_path=... (a Hugging Face checkpoint of the model), "
                     f"or peft=none")
        if cfg.graph.name == "ort":
            p.append(f"{what} with graph=ort: not combined here; onnxruntime-training runs in "
                     f"its own torch 2.4-2.6 environment, where peft's adapters and the "
                     f"adapter-only checkpoints are not built; use graph=eager or graph=compile "
                     f"with {what}")
        if cfg.precision.fp8_scaling is not None:
            p.append(f"{what} with precision=fp8: not combined here; torchao would convert the "
                     f"frozen base layers that peft wraps, a pairing not built or tested; use "
                     f"precision=bf16 with {what}")
        if cfg.trainer.unpad:
            p.append(f"{what} with trainer.unpad=true: not combined here; the unpadded path "
                     f"replaces BERT's forward, which peft's task wrappers do not pass its packed "
                     f"inputs to; set trainer.unpad=false")
        if pe.base_dtype == "bf16" and cfg.precision.dtype != "bf16":
            p.append(f"peft.base_dtype=bf16 with precision={cfg.precision.dtype}: a bf16 base "
                     f"computes under bf16 autocast only; use precision=bf16, or "
                     f"peft.base_dtype=auto")
        if pe.fused and cfg.memory.name in ("zero3", "fsdp"):
            p.append(f"peft.fused=true with memory={cfg.memory.name}: the fused function reads "
                     f"each base layer's weight outside the layer's forward, where "
                     f"{'ZeRO-3' if cfg.memory.name == 'zero3' else 'FSDP2'} has not gathered "
                     f"it; set peft.fused=false, or use memory=none, zero1 or zero2")
        if pe.fused and cfg.graph.name == "compile":
            p.append("peft.fused=true with graph=compile: a compiled graph traces peft's own "
                     "LoRA modules, so the fused function would never run; set "
                     "peft.fused=false with graph=compile, or use graph=eager with peft.fused")
        if pe.fused and m.source == "config" and m.arch == "gpt2":
            p.append(f"peft.fused=true with model={m.name}: GPT-2's Conv1D layers keep peft's "
                     f"own path (the fused function covers torch.nn.Linear and bitsandbytes' "
                     f"4-bit layers); set peft.fused=false, or use a Llama-shaped model")
        if pe.name == "qlora":
            p.extend(_qlora_problems(cfg))
        return p

    @classmethod
    def environment_problems(cls, cfg: RunConfig, device: torch.device) -> list[Problem]:
        """peft installed; qlora's CUDA device and bitsandbytes."""
        if not installed("peft"):
            return [Problem(f"peft=lora/qlora needs peft, which is not installed: {INSTALL}",
                            EXIT_NOT_AVAILABLE)]
        if cfg.peft.name != "qlora" or cfg.trainer.device == "cpu":
            return []  # trainer.device=cpu: the config's own problem says it (_qlora_problems)
        if device.type != "cuda":
            return [Problem(f"peft=qlora keeps the base weights in 4 bits with bitsandbytes' "
                            f"CUDA kernels; this run is on '{device.type}', where they are a "
                            f"slow fallback that saves no accelerator memory. Use peft=lora "
                            f"here, or run on a CUDA GPU")]
        if not installed("bitsandbytes"):
            return [Problem(f"peft=qlora needs bitsandbytes for the 4-bit base weights, which "
                            f"is not installed: {BNB_INSTALL}", EXIT_NOT_AVAILABLE)]
        return []

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.adapters: Adapters | None = None  # what `apply` attached

    def apply(self, model: nn.Module, context: ApplyContext) -> nn.Module:
        model, self.adapters = attach(model, self.cfg, context.run_dir)
        return model

    def flops_parameters(self, trainable: int, total: int) -> float | None:
        return self.adapters.flops_parameters

    # --- checkpoints ----------------------------------------------------------------------------
    def state_filter(self) -> StateFilter:
        return TrainableOnly()

    def record(self) -> dict:
        return self.adapters.record()

    def write_files(self, directory: Path) -> None:
        self.adapters.write(directory)  # what `rapidformer export` rebuilds the model from

    def checkpoint_written(self) -> None:
        self.adapters.log_checkpoint()

    def resume_problem(self, record: dict | None) -> str | None:
        if record is None:
            return (f"holds a whole model (trained with peft=none), and this run trains "
                    f"peft={self.adapters.method} adapters; resume with peft=none, or start a "
                    f"fresh run from its export (model.source=pretrained "
                    f"model.name_or_path=EXPORT_DIR)")
        mine = self.adapters.record()
        changed = [f"{key}={mine.get(key)} (was {record.get(key)})"
                   for key in RESUMED_SETTINGS if mine.get(key) != record.get(key)]
        if changed:
            return (f"holds adapters of other settings, changed: {', '.join(changed)}; resume "
                    f"with the peft settings it was trained with")
        if mine["base_fingerprint"] != record["base_fingerprint"]:
            return (f"cannot be resumed here: the checkpoint's adapters were trained on another "
                    f"base model (base fingerprint {record['base_fingerprint'][:12]}, this run's "
                    f"base {mine['base_fingerprint'][:12]}: other frozen weights than the "
                    f"checkpoint's {record['base_class']} had); resume with the base it was "
                    f"trained on, or start a fresh run (a new trainer.output_dir, or "
                    f"trainer.overwrite=true without trainer.resume)")
        return None

    @classmethod
    def problem_without(cls, record: dict) -> str | None:
        return (f"holds peft={record['method']} adapters only, and this run trains the whole "
                f"model (peft=none); resume with peft={record['method']}, or start a fresh run "
                f"from its merged export (`rapidformer export`)")

    # --- export ---------------------------------------------------------------------------------
    def export(self, model: nn.Module, state_dict: dict | None):
        """The base with the adapters merged in, a plain Hugging Face model."""
        merged = self.adapters.merged(model, state_dict)
        return None if merged is None else (merged, None)

    @classmethod
    def offline_weights(cls, checkpoint_dir: Path, record: dict, weights: dict) -> dict:
        return merged_weights(checkpoint_dir, record, weights)


def _qlora_problems(cfg: RunConfig) -> list[str]:
    """What bitsandbytes' 4-bit base weights rule out."""
    m, p = cfg.model, []
    if cfg.trainer.device == "cpu":
        p.append("peft=qlora with trainer.device=cpu: QLoRA is for CUDA GPUs, where "
                 "bitsandbytes' 4-bit kernels keep the base in a quarter of its memory; on a CPU "
                 "its 4-bit matmul is a slow fallback computed in bf16 that saves no accelerator "
                 "memory. Use peft=lora on a CPU, or run on a CUDA GPU")
    if cfg.memory.name == "fsdp":
        p.append("peft=qlora with memory=fsdp: FSDP2's fully_shard turns each weight into a "
                 "plain sharded tensor, which drops the 4-bit quantization state "
                 "(bitsandbytes' Params4bit) that the 4-bit matmul reads; use peft=lora with "
                 "memory=fsdp, or peft=qlora with memory=none, zero1 or zero2")
    if cfg.memory.name == "zero3":
        p.append("peft=qlora with memory=zero3: ZeRO-3 partitions every weight, and "
                 "bitsandbytes' 4-bit weights partition only when transformers quantizes them "
                 "while DeepSpeed builds the model (zero.Init inside from_pretrained), not when a "
                 "built model is quantized as here; use peft=lora with memory=zero3, or "
                 "peft=qlora with memory=none, zero1 or zero2")
    if m.source == "config" and m.arch == "gpt2":
        p.append(f"peft=qlora with model={m.name}: bitsandbytes quantizes torch.nn.Linear "
                 f"layers, and GPT-2's blocks are transformers' Conv1D layers; use peft=lora, or "
                 f"a Llama-shaped model (model=llama_tiny, llama_1b)")
    return p
