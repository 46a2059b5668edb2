"""peft=lora/qlora: the tensors of an adapter checkpoint and the whole models made from them.

A checkpoint holds the parameters that train (the adapters and the modules trained in full);
`merge` turns a peft model's whole state into the plain Hugging Face base class with the
adapters merged in (the run's export), `merged_weights` does the same offline from a checkpoint
and its base read again (`rapidformer export`, eval, predict), and `write_adapter_dir` writes
peft's own adapter directory (`rapidformer export --adapter-only`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from rapidformer.errors import InputError
from rapidformer.models.wrapped_names import bare_name
from rapidformer.transforms.lora_layers import base_fingerprint, import_peft

# in a checkpoint: peft's adapter_config.json and the base model's config
FILES_DIR = "peft"
BASE_CONFIG = "base_config.json"


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


def with_adapters(base: nn.Module, ckpt: Path, record: dict, adapter_state: dict) -> nn.Module:
    """`base` (a Hugging Face model) with a checkpoint's adapters; refused when its frozen
    weights are not the ones the adapters were trained on."""
    peft = import_peft()
    lora, _ = checkpoint_files(ckpt)
    if base_fingerprint(base, record["modules_trained_in_full"]) != record["base_fingerprint"]:
        raise InputError(f"{ckpt}: the checkpoint's adapters were trained on another base model "
                         f"than this {type(base).__name__} (its frozen weights differ from those "
                         f"the run trained on); give the run's base model")
    model = peft.get_peft_model(base, _fresh(lora))
    result = model.load_state_dict(adapter_state, strict=False)
    check_loaded(model, result.missing_keys, result.unexpected_keys, ckpt)
    return model


def pretrained_base(ckpt: Path, record: dict) -> nn.Module:
    """The run's base model, read again from its pretrained directory (or hub name)."""
    import transformers

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


def merged_weights(ckpt: Path, record: dict, adapter_state: dict) -> dict:
    """The whole model's fp32 weights of an adapter checkpoint: its base, read again, with the
    adapters merged in (what `rapidformer export`, eval and predict load)."""
    model = with_adapters(pretrained_base(ckpt, record), ckpt, record, adapter_state)
    base_config = copy.deepcopy(model.get_base_model().config)  # before the unload unties it
    merged = tied_as_trained(model.merge_and_unload(), base_config)
    return {k: v.float() if v.is_floating_point() else v for k, v in merged.state_dict().items()}


def write_adapter_dir(ckpt: Path, record: dict, adapter_state: dict, out: Path,
                      base_name_or_path: str) -> None:
    """peft's adapter directory (adapter_config.json, adapter_model.safetensors) of a
    checkpoint, built on a meta-device base: no base weights are read or needed. Its config
    names `base_name_or_path`, where peft's AutoPeftModel* classes read the base from."""
    peft = import_peft()
    import transformers

    lora, config = checkpoint_files(ckpt)
    model_class = getattr(transformers, record["base_class"])
    with torch.device("meta"):
        base = model_class(config)
    model = peft.get_peft_model(base, _fresh(lora))
    result = model.load_state_dict(adapter_state, assign=True, strict=False)
    check_loaded(model, result.missing_keys, result.unexpected_keys, ckpt)
    model.peft_config["default"].modules_to_save = _fresh(model.peft_config["default"]) \
        .modules_to_save
    model.save_pretrained(str(out))
    # named after saving: peft's save would look the name up (on the hub, for a hub name)
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_name_or_path
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
