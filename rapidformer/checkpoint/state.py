"""What a checkpoint records (its state.json), typed and versioned.

    {"format_version": 1, "step": 40, "train_state": {...}, "world_size": 2,
     "strategy": "ddp", "memory": "none", "layout": {...},
     "model": {"num_parameters": 141636, "settings": {"arch": "bert", ...}},
     "transforms": {"lora": {...}}, "extra": {...}}

`train_state` is the template's data position (a Finetuner's epochs and steps, a PreTrainer's
consumed samples) and its best evaluation; `layout` is what the strategy records of its parallel
layout (random streams restore only at the same one); `transforms` holds each model transform's
record (rapidformer/transforms/); `extra` keeps whatever else an own-loop script saved.

Version 0 is the flat state.json of the releases before this format (layout keys, the model's
record and peft's at the top level): `from_json` reads it, so their checkpoints still resume
and export.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
STATE_FILE = "state.json"

# the model settings a checkpoint records, to say which changed when its weights do not fit
MODEL_SETTINGS = ("name", "source", "name_or_path", "arch", "hidden_size", "num_layers",
                  "num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "max_position_embeddings", "vocab_size", "tokenizer")
# version 0: the keys strategies' layouts wrote at the top level
_V0_LAYOUT = ("tensor_parallel", "pipeline_parallel", "precision")
_V0_KNOWN = {"step", "train_state", "world_size", "strategy", "memory", "num_parameters",
             "model", "peft", *_V0_LAYOUT}


@dataclass
class ModelRecord:
    num_parameters: int
    settings: dict = field(default_factory=dict)


@dataclass
class CheckpointState:
    step: int
    train_state: dict = field(default_factory=dict)
    world_size: int = 1
    strategy: str | None = None  # None: a version-0 checkpoint older than recorded strategies
    memory: str = "none"
    layout: dict = field(default_factory=dict)
    model: ModelRecord | None = None
    transforms: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION

    # --- the file -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        record = asdict(self)
        record.pop("version")
        return {"format_version": FORMAT_VERSION, **record}

    @classmethod
    def from_json(cls, data: dict, where="state.json") -> CheckpointState:
        from rapidformer.errors import InputError

        version = data.get("format_version", 0)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise InputError(f"{where} has checkpoint format {version!r}, newer than this "
                             f"version reads ({FORMAT_VERSION}); use the rapidformer that wrote "
                             f"it, or a newer one")
        try:
            return _v0(data) if version == 0 else _v1(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{where} is not a checkpoint state this version can read "
                             f"({type(exc).__name__}: {exc}); it was not written by rapidformer, "
                             f"or was changed by hand") from None

    def user_view(self) -> dict:
        """What engine.load_checkpoint returns: the dict the template or own loop saved
        (step, train_state, its own keys)."""
        return {**self.extra, "step": self.step, "train_state": self.train_state}


def _v1(data: dict) -> CheckpointState:
    model = data.get("model")
    return CheckpointState(
        step=int(data["step"]), train_state=dict(data.get("train_state") or {}),
        world_size=int(data.get("world_size", 1)), strategy=data.get("strategy"),
        memory=data.get("memory", "none"), layout=dict(data.get("layout") or {}),
        model=ModelRecord(int(model["num_parameters"]), dict(model.get("settings") or {}))
        if model else None,
        transforms=dict(data.get("transforms") or {}), extra=dict(data.get("extra") or {}))


def _v0(data: dict) -> CheckpointState:
    """The flat state.json of the releases before format 1."""
    layout = {k: data[k] for k in _V0_LAYOUT if k in data}
    if "tensor_parallel" in layout and "world_size" in data:
        layout["world_size"] = data["world_size"]  # megatron's layout recorded it too
    model = ModelRecord(int(data["num_parameters"]), dict(data.get("model") or {})) \
        if data.get("num_parameters") is not None else None
    return CheckpointState(
        step=int(data["step"]), train_state=dict(data.get("train_state") or {}),
        world_size=int(data.get("world_size", 1)), strategy=data.get("strategy"),
        memory=data.get("memory", "none"), layout=layout, model=model,
        transforms={"lora": data["peft"]} if data.get("peft") else {},
        extra={k: v for k, v in data.items() if k not in _V0_KNOWN}, version=0)


def model_record(model_cfg, num_parameters: int | None) -> ModelRecord | None:
    """What a checkpoint records of the model (None: an own loop saving before compose())."""
    if num_parameters is None:
        return None
    fields = asdict(model_cfg)
    return ModelRecord(num_parameters, {k: fields[k] for k in MODEL_SETTINGS if k in fields})


def read_state(path: Path) -> CheckpointState:
    """The state of checkpoint directory `path`."""
    from rapidformer.errors import InputError

    file = Path(path) / STATE_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{file} cannot be read ({exc}); verify the checkpoint with "
                         f"`rapidformer verify`, or resume from another one") from None
    if not isinstance(data, dict):
        raise InputError(f"{file} holds no checkpoint state (a JSON object); it was not written "
                         f"by rapidformer, or was changed by hand")
    return CheckpointState.from_json(data, file)
