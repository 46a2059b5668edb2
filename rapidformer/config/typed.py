"""A composed config's plain dict as a typed `RunConfig`: unknown keys (with the closest valid
name) and wrong types, every one reported at once."""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Literal, Union

from rapidformer.config.schema import RunConfig
from rapidformer.errors import ConfigError


def closest(name: str, choices) -> str | None:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_message(path: str, key: str, valid) -> str:
    hint = closest(key, valid)
    where = f"{path}.{key}" if path else key
    if hint:
        full = f"{path}.{hint}" if path else hint
        return f"{where}: unknown key; did you mean '{full}'?"
    return f"{where}: unknown key; valid keys here: {', '.join(sorted(valid))}"


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    if origin is list:
        item, = typing.get_args(tp) or (Any,)
        return f"a list of {_describe(item).removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp) -> tuple[bool, Any]:
    """(ok, value converted to tp). Accepts an int where a float is expected, nothing looser."""
    origin = typing.get_origin(tp)
    if origin is Union:
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            ok, converted = _coerce(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return (value in typing.get_args(tp) and not isinstance(value, bool)), value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        item, = typing.get_args(tp) or (Any,)
        converted = [_coerce(v, item) for v in value]
        return all(ok for ok, _ in converted), [v for _, v in converted]
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return math.isfinite(float(value)), float(value)
        return False, value
    if tp is dict:
        return isinstance(value, dict), value
    if tp is str:
        # YAML turns `mrpc` into a str but `1.0` into a float: a str field takes plain scalars
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, value
    return True, value


def _build(cls, raw: Any, path: str, problems: list[str]):
    if not isinstance(raw, dict):
        problems.append(f"{path or 'config'}: expected a mapping of keys, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            problems.append(unknown_key_message(path, str(key), fields))
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        where = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw[name], where, problems)
            continue
        ok, converted = _coerce(raw[name], tp)
        if not ok:
            problems.append(f"{where}: expected {_describe(tp)}, got {raw[name]!r}")
            continue
        values[name] = converted
    return cls(**values)




def typed_config(raw: dict) -> RunConfig:
    """The typed config of a resolved plain dict; raises ConfigError listing every unknown key
    and wrong type."""
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg
