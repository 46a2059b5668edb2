"""peft=lora / qlora: low-rank adapters (peft's LoRA) on a Hugging Face model, its base frozen.

`attach` turns the model a template, task or own-loop script built into a peft model in
`engine.compose`, before it moves to its device and before any strategy wraps it: the one
point every run passes. The targets are the attention and MLP projections of the model's
family unless peft.target_modules names them; a classification or QA head trains in full
(peft's task types keep it in modules_to_save), as do peft.modules_to_save. With qlora the
linear layers of the transformer blocks become bitsandbytes 4-bit layers first; they quantize as
they move to the GPU, so the full-precision base never sits in GPU memory (it is read on the CPU
as the model builder loaded it).

What the rest of the run sees: the strategies save and load the trainable parameters (adapters
and fully trained modules) and their optimizer state only; a checkpoint records the adapters'
settings, peft's adapter_config.json, the base model's config and a fingerprint of the frozen
base, and a resume on another base is refused. A base that no file holds (built from the config,
its weights random) is written once to RUN_DIR/peft_base, so that the checkpoints stay
exportable. The run's export merges the adapters into a
copy of the base (a plain Hugging Face model, no peft needed to load it); `rapidformer export
--adapter-only` writes peft's own adapter directory from a checkpoint.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rapidformer.config.schema import PeftConfig, RunConfig
from rapidformer.errors import ConfigError, InputError, NotAvailableError
from rapidformer.models.blocks import transformer_blocks
from rapidformer.models.wrapped_names import bare_name

log = logging.getLogger("rapidformer")

INSTALL = "pip install 'rapidformer[peft]' (peft>=0.21,<0.22)"
BNB_INSTALL = "pip install bitsandbytes"
LLAMA_FAMILY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the layers LoRA adapts when peft.target_modules is null, by Hugging Face model type
DEFAULT_TARGETS = {"llama": LLAMA_FAMILY, "mistral": LLAMA_FAMILY, "qwen2": LLAMA_FAMILY,
                   "qwen3": LLAMA_FAMILY, "gpt2": ("c_attn", "c_proj", "c_fc"),
                   "bert": ("query", "key", "value", "dense")}
# the heads peft's task types train in full beside the adapters (peft adds them itself)
TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
              "QUESTION_ANS": ("qa_outputs",)}
# in a checkpoint: peft's adapter_config.json and the base model's config
FILES_DIR = "peft"
BASE_CONFIG = "base_config.json"
# in the run directory: the frozen base of a model built from its config (save_pretrained), and
# the fingerprint it was written with
BASE_COPY = "peft_base"
BASE_COPY_FINGERPRINT = "rapidformer_fingerprint.txt"
# values of each frozen tensor that the fingerprint reads, evenly spread: any retraining or
# another checkpoint of the base changes them, and hashing stays cheap at any model size
FINGERPRINT_SAMPLES = 1024
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def import_peft():
    try:
        import peft
    except ImportError as exc:
        raise NotAvailableError(f"peft=lora/qlora needs peft, which is not installed: "
                                f"{INSTALL}") from exc
    return peft


def check_available(p: PeftConfig, on_gpu: bool) -> None:
    """Before any work (the factory's check): peft installed, and qlora's device and
    bitsandbytes."""
    if p.name == "none":
        return
    import_peft()
    check_device(p, torch.device("cuda" if on_gpu else "cpu"))


def check_device(p: PeftConfig, device: torch.device) -> None:
    """qlora is for CUDA GPUs (bitsandbytes' 4-bit kernels): refused elsewhere, before any
    work (trainer.device=auto on a machine without one)."""
    if p.name != "qlora":
        return
    if device.type != "cuda":
        raise ConfigError([f"peft=qlora keeps the base weights in 4 bits with bitsandbytes' CUDA "
                           f"kernels; this run is on '{device.type}', where they are a slow "
                           f"fallback that saves no accelerator memory. Use peft=lora here, or "
                           f"run on a CUDA GPU"])
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise NotAvailableError(f"peft=qlora needs bitsandbytes for the 4-bit base weights, "
                                f"which is not installed: {BNB_INSTALL}") from exc


# --- what gets adapters ----------------------------------------------------------------------

def matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of names: the module's full name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def linear_layer_names(model: nn.Module) -> list[str]:
    """The last name part of every linear layer (nn.Linear, GPT-2's Conv1D): what
    peft.target_modules can name."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if name and (isinstance(m, nn.Linear) or _is_conv1d(m))})


def module_names(model: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name})


def target_modules(model: nn.Module, p: PeftConfig) -> list[str]:
    if p.target_modules is not None:
        return list(p.target_modules)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_TARGETS:
        names = linear_layer_names(model)
        raise ConfigError([f"peft.target_modules=null: {type(model).__name__} (model type "
                           f"{model_type}) has no default LoRA targets (the defaults cover "
                           f"{', '.join(DEFAULT_TARGETS)}); name its linear layers to adapt, "
                           f"e.g. peft.target_modules=[{','.join(names[:2])}] (it has: "
                           f"{', '.join(names)})"])
    return list(DEFAULT_TARGETS[model_type])


def check_names(model: nn.Module, names: list[str], key: str, known: list[str]) -> None:
    """A name that matches no module of the model is refused with the names it has."""
    modules = [name for name, _ in model.named_modules() if name]
    unmatched = [n for n in names if not any(matches(m, n) for m in modules)]
    if unmatched:
        raise ConfigError([f"{key}: {', '.join(unmatched)} match{'es' * (len(unmatched) == 1)} "
                           f"no module of {type(model).__name__}; its "
                           f"{'linear layers' if key == 'peft.target_modules' else 'modules'} "
                           f"are named {', '.join(known)}: choose among them"])


def task_type(model: nn.Module) -> str | None:
    """peft's task type of a transformers model class (None: a plain peft model)."""
    from transformers.models.auto import modeling_auto as auto

    name = type(model).__name__
    for mapping, task in ((auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "SEQ_CLS"),
                          (auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, "TOKEN_CLS"),
                          (auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, "QUESTION_ANS"),
                          (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "CAUSAL_LM"),
                          (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "SEQ_2_SEQ_LM")):
        classes = {c for v in mapping.values() for c in (v if isinstance(v, tuple) else (v,))}
        if name in classes:
            return task
    return None


def trained_in_full(model: nn.Module, p: PeftConfig, task: str | None) -> list[str]:
    """peft.modules_to_save and the task's head where the model has one."""
    heads = [h for h in TASK_HEADS.get(task, ()) if any(matches(n, h) for n, _ in
                                                        model.named_modules())]
    return list(dict.fromkeys([*(p.modules_to_save or []), *heads]))


def lora_config(model: nn.Module, p: PeftConfig, targets: list[str], task: str | None):
    peft = import_peft()
    # GPT-2's Conv1D stores its weight as (in, out): LoRA's update is transposed for it
    conv1d = any(_is_conv1d(m) and any(matches(n, t) for t in targets)
                 for n, m in model.named_modules())
    return peft.LoraConfig(r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                           target_modules=targets, modules_to_save=p.modules_to_save or None,
                           task_type=task, fan_in_fan_out=conv1d, bias="none")


# --- the frozen base -------------------------------------------------------------------------

def _in_modules(param_name: str, modules: list[str]) -> bool:
    parts = param_name.split(".")[:-1]
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(matches(prefix, m) for prefix in prefixes for m in modules)


def base_fingerprint(model: nn.Module, full: list[str]) -> str:
    """sha256 over the base's tensors that stay frozen (every parameter outside `full`): each
    one's name, shape, dtype and FINGERPRINT_SAMPLES of its values."""
    digest = hashlib.sha256()
    for name, tensor in model.named_parameters():
        if _in_modules(name, full):
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() and not flat.is_meta:
            index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), FINGERPRINT_SAMPLES),
                                   device=flat.device).long()
            digest.update(flat[index].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def quantize_blocks(model: nn.Module, p: PeftConfig, precision_dtype: str) -> None:
    """qlora: every nn.Linear of the transformer blocks becomes a bitsandbytes Linear4bit that
    holds the same weight and quantizes it (quant_type, double quantization of the scales) when
    the engine moves the model to the GPU; it computes in the precision group's dtype."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=p.quant_type,
                           bnb_4bit_use_double_quant=p.double_quant,
                           bnb_4bit_compute_dtype=COMPUTE_DTYPES[precision_dtype])
    layers = [(block, name, layer) for block in transformer_blocks(model)
              for name, layer in block.named_modules()]
    conv1d = sorted({name.rsplit(".", 1)[-1] for _, name, layer in layers if _is_conv1d(layer)})
    if conv1d:
        raise ConfigError([f"peft=qlora with {type(model).__name__}: bitsandbytes quantizes "
                           f"torch.nn.Linear layers, and its {', '.join(conv1d)} are "
                           f"transformers' Conv1D layers; use peft=lora, or a Llama-family "
                           f"model"])
    for block, name, layer in layers:
        if type(layer) is nn.Linear:
            block.set_submodule(name, _four_bit(bnb, layer, q))
    # the flag transformers' 4-bit loader sets: peft reads it to give Linear4bit layers its
    # 4-bit LoRA layers, and prepare_model_for_kbit_training to treat the model as quantized
    model.is_loaded_in_4bit = True


def _four_bit(bnb, layer: nn.Linear, q) -> nn.Module:
    four = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                             compute_dtype=q.bnb_4bit_compute_dtype,
                             compress_statistics=q.bnb_4bit_use_double_quant,
                             quant_type=q.bnb_4bit_quant_type,
                             quant_storage=q.bnb_4bit_quant_storage, device="meta")
    four.weight = bnb.nn.Params4bit(layer.weight.data, requires_grad=False,
                                    compress_statistics=q.bnb_4bit_use_double_quant,
                                    quant_type=q.bnb_4bit_quant_type,
                                    quant_storage=q.bnb_4bit_quant_storage, module=four)
    if layer.bias is not None:
        four.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    return four


# --- attaching -------------------------------------------------------------------------------

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

    def files_with(self, extra):
        """A checkpoint's extra-files writer: the template's (`extra`, or None) and `write`'s
        (what `rapidformer export` rebuilds the model from)."""
        def write(directory: Path) -> None:
            self.write(directory)
            if extra is not None:
                extra(directory)
        return write

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
                     if not _in_modules(n, full))
    base_config = copy.deepcopy(model.config) if hasattr(model, "config") else None
    source = cfg.model.name_or_path if cfg.model.source == "pretrained" else None
    copied = source is None and hasattr(model, "save_pretrained")
    if copied and run_dir is not None:
        keep_base(model, fingerprint, run_dir)
    if p.name == "qlora":
        quantize_blocks(model, p, cfg.precision.dtype)
        # casts what is left in half precision to fp32 and freezes the base; recompute is the
        # strategy's (trainer.checkpoint_activations), non-reentrant: it needs no input grads
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as exc:  # a target of a kind LoRA cannot adapt, in peft's words
        raise ConfigError([f"peft.target_modules={targets}: {exc}"]) from exc
    trainable, total = model.get_nb_trainable_parameters()
    model_state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()
                            if t.requires_grad)
    log.info("peft=%s: %s of %s parameters train (%.2f%%): r=%d adapters on %s%s", p.name,
             f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1), p.r,
             ", ".join(targets), f"; in full: {', '.join(full)}" if full else "")
    adapters = Adapters(p.name, model.peft_config["default"], type(model.get_base_model()).__name__,
                        base_config, source, BASE_COPY if copied else None, full, fingerprint,
                        trainable, total,
                        model_state_bytes, base_bytes,
                        quant_type=p.quant_type if p.name == "qlora" else None)
    return model, adapters


# --- checkpoints -----------------------------------------------------------------------------

def trainable_state(model: nn.Module) -> dict:
    """The parameters that train, by their state-dict names: what a checkpoint holds."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def check_loaded(model: nn.Module, missing: list[str], unexpected: list[str], where) -> None:
    """After a load of trainable parameters only: every trainable one came from the file and
    the file held nothing else."""
    trainable = set(trainable_state(model))
    missed = [k for k in missing if k in trainable]
    if missed or unexpected:
        raise InputError(f"{where} does not fit this run's adapters: missing {missed[:5]}, "
                         f"unexpected {list(unexpected)[:5]}; resume with the peft settings "
                         f"and model it was trained with")


def resume_problem(saved: dict, adapters: Adapters | None) -> str | None:
    """Why a checkpoint (state.json `saved`) cannot resume this run's adapters (a phrase after
    "checkpoint PATH "), or None."""
    record = saved.get("peft")
    if record is None and adapters is None:
        return None
    if record is None:
        return (f"holds a whole model (trained with peft=none), and this run trains "
                f"peft={adapters.method} adapters; resume with peft=none, or start a fresh run "
                f"from its export (model.source=pretrained model.name_or_path=EXPORT_DIR)")
    if adapters is None:
        return (f"holds peft={record['method']} adapters only, and this run trains the whole "
                f"model (peft=none); resume with peft={record['method']}, or start a fresh run "
                f"from its merged export (`rapidformer export`)")
    mine = adapters.record()
    changed = [f"{key}={mine.get(key)} (was {record.get(key)})"
               for key in ("method", "r", "alpha", "target_modules", "modules_trained_in_full",
                           "quant_type") if mine.get(key) != record.get(key)]
    if changed:
        return (f"holds adapters of other settings, changed: {', '.join(changed)}; resume with "
                f"the peft settings it was trained with")
    if mine["base_fingerprint"] != record["base_fingerprint"]:
        return (f"cannot be resumed here: the checkpoint's adapters were trained on another base "
                f"model (base fingerprint {record['base_fingerprint'][:12]}, this run's base "
                f"{mine['base_fingerprint'][:12]}: other frozen weights than the checkpoint's "
                f"{record['base_class']} had); resume with the base it was trained on, or start a "
                f"fresh run (a new trainer.output_dir, or trainer.overwrite=true)")
    return None


# --- export ----------------------------------------------------------------------------------

def fp32_copy(state: dict) -> dict:
    """CPU fp32 copies: the merge then writes into its own tensors, never the live model's."""
    return {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype,
                             copy=True) for k, v in state.items()}


def full_precision_state(model: nn.Module) -> dict:
    """The peft model's state dict as CPU fp32 copies, 4-bit base weights dequantized into
    their full-precision values (the bitsandbytes quantization state left out)."""
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        weight = module.__dict__.get("_parameters", {}).get("weight")
        if type(weight).__name__ != "Params4bit":
            continue
        from peft.utils.integrations import dequantize_module_weight

        prefix = f"{name}.weight."
        for key in [k for k in state if k.startswith(prefix)]:
            del state[key]
        state[f"{name}.weight"] = dequantize_module_weight(module)
    return fp32_copy(state)


def merge(base_class: type, base_config, lora: object, state: dict, buffers: dict) -> nn.Module:
    """`state` (a peft model's whole state) loaded into a peft model of `base_class` built on
    the meta device (its tensors become those of `state`: no second copy), then merged and
    unloaded into the plain base class. `buffers`: the live peft model's, for those no state
    dict holds (non-persistent ones, e.g. rotary frequencies), which would stay on meta."""
    peft = import_peft()
    with torch.device("meta"):
        base = base_class(copy.deepcopy(base_config))
    skeleton = peft.get_peft_model(base, _fresh(lora))
    result = skeleton.load_state_dict(state, assign=True, strict=False)
    live = {bare_name(name): b for name, b in buffers.items()}
    for name, buffer in list(skeleton.named_buffers()):
        if buffer.is_meta and name in live:
            owner, _, leaf = name.rpartition(".")
            skeleton.get_submodule(owner)._buffers[leaf] = live[name].detach().to("cpu",
                                                                                  copy=True)
    unfilled = [n for n, p in [*skeleton.named_parameters(), *skeleton.named_buffers()]
                if p.is_meta]
    if unfilled or result.unexpected_keys:
        raise InputError(f"the adapters' state does not fit {base_class.__name__}: missing "
                         f"{unfilled[:5]}, unexpected {result.unexpected_keys[:5]}")
    return tied_as_trained(skeleton.merge_and_unload(), base_config)


def tied_as_trained(model: nn.Module, base_config) -> nn.Module:
    """A merged model of a base that ties its input and output embeddings (peft's unload
    unties them in the config when they are two tensors): tied again where they are equal;
    left untied where the output layer trained in full (peft.modules_to_save), which peft
    trains as a copy of its own."""
    if not getattr(base_config, "tie_word_embeddings", False):
        return model
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or torch.equal(head.weight, embedding.weight):
        model.config.tie_word_embeddings = True
        model.tie_weights()
    else:
        model.config.tie_word_embeddings = False
    return model


def _fresh(lora):
    """A copy of a LoraConfig for another model (peft extends modules_to_save with the task's
    heads once more when it builds one)."""
    config = copy.deepcopy(lora)
    if config.modules_to_save:
        config.modules_to_save = list(dict.fromkeys(config.modules_to_save))
    return config


def checkpoint_files(ckpt: Path):
    """(peft's LoraConfig, the base's transformers config) that a checkpoint keeps."""
    peft = import_peft()
    import transformers

    folder = ckpt / FILES_DIR
    if not (folder / "adapter_config.json").is_file() or not (folder / BASE_CONFIG).is_file():
        raise InputError(f"{ckpt} has no {FILES_DIR}/adapter_config.json and {BASE_CONFIG}: it "
                         f"is not a checkpoint of peft adapters that this version wrote")
    lora = peft.LoraConfig.from_pretrained(str(folder))
    config = transformers.AutoConfig.from_pretrained(str(folder / BASE_CONFIG))
    return lora, config


def with_adapters(base: nn.Module, ckpt: Path, saved: dict, adapter_state: dict) -> nn.Module:
    """`base` (a Hugging Face model) with a checkpoint's adapters; refused when its frozen
    weights are not the ones the adapters were trained on."""
    peft = import_peft()
    record = saved["peft"]
    lora, _ = checkpoint_files(ckpt)
    if base_fingerprint(base, record["modules_trained_in_full"]) != record["base_fingerprint"]:
        raise InputError(f"{ckpt}: the checkpoint's adapters were trained on another base model "
                         f"than this {type(base).__name__} (its frozen weights differ from those "
                         f"the run trained on); give the run's base model")
    model = peft.get_peft_model(base, _fresh(lora))
    result = model.load_state_dict(adapter_state, strict=False)
    check_loaded(model, result.missing_keys, result.unexpected_keys, ckpt)
    return model


def pretrained_base(ckpt: Path, saved: dict) -> nn.Module:
    """The run's base model, read again from its pretrained directory (or hub name)."""
    import transformers

    record = saved["peft"]
    name = record.get("base_name_or_path")
    if not name and record.get("base_copy"):
        name = str(ckpt.parent.parent / record["base_copy"])
        if not Path(name).is_dir():
            raise InputError(f"{ckpt} holds peft={record['method']} adapters only, and the copy "
                             f"of their base that the run wrote ({name}) is gone; export the "
                             f"adapters (`--adapter-only`), or use the run's own RUN_DIR/hf_model")
    if not name:
        raise InputError(f"{ckpt} holds peft={record['method']} adapters only, and their base "
                         f"({record['base_class']}) was built from the config with random "
                         f"weights that no file keeps; export the adapters (`rapidformer export "
                         f"RUN_DIR --to DIR --adapter-only`), or use the merged model the run "
                         f"exported itself (RUN_DIR/hf_model, trainer.export_hf=true)")
    _, config = checkpoint_files(ckpt)
    model_class = getattr(transformers, record["base_class"], None)
    if model_class is None:
        raise InputError(f"{ckpt}: its base class {record['base_class']} is not in this version "
                         f"of transformers")
    try:
        return model_class.from_pretrained(name, config=config)
    except OSError as exc:
        raise InputError(f"{ckpt}: its base model {name} cannot be read ({exc}); make it "
                         f"reachable (a local directory, or the hub's cache)") from exc


def merged_weights(ckpt: Path, saved: dict, adapter_state: dict) -> dict:
    """The whole model's fp32 weights of an adapter checkpoint: its base, read again, with the
    adapters merged in (what `rapidformer export`, eval and predict load)."""
    model = with_adapters(pretrained_base(ckpt, saved), ckpt, saved, adapter_state)
    base_config = copy.deepcopy(model.get_base_model().config)  # before the unload unties it
    merged = tied_as_trained(model.merge_and_unload(), base_config)
    return {k: v.float() if v.is_floating_point() else v for k, v in merged.state_dict().items()}


def write_adapter_dir(ckpt: Path, saved: dict, adapter_state: dict, out: Path) -> None:
    """peft's adapter directory (adapter_config.json, adapter_model.safetensors) of a
    checkpoint, built on a meta-device base: no base weights are read or needed."""
    peft = import_peft()
    import transformers

    lora, config = checkpoint_files(ckpt)
    model_class = getattr(transformers, saved["peft"]["base_class"])
    with torch.device("meta"):
        base = model_class(config)
    model = peft.get_peft_model(base, _fresh(lora))
    result = model.load_state_dict(adapter_state, assign=True, strict=False)
    check_loaded(model, result.missing_keys, result.unexpected_keys, ckpt)
    model.peft_config["default"].modules_to_save = _fresh(model.peft_config["default"]) \
        .modules_to_save
    model.save_pretrained(str(out))
