"""The recipes: one YAML file each, `# @package _global_` deltas over the root config, used as
`+recipe=NAME`.

They sit beside the config groups (the package rapidformer.conf), not in a `recipe` folder among
them, so Hydra does not find them by path: importing this package registers each file with
Hydra's ConfigStore as the option NAME of the group `recipe`. rapidformer.conf imports it, and
Hydra imports rapidformer.conf before it composes, so every composition sees them.
"""
from __future__ import annotations

import re
from importlib import resources

GROUP = "recipe"
PACKAGE_HEADER = re.compile(r"#\s*@package\s+(\S+)")


def package_of(text: str) -> str | None:
    """The `# @package` of a file's header (Hydra reads it from a file; the store is told it)."""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        match = PACKAGE_HEADER.match(line)
        if match:
            return match.group(1)
    return None


def register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for file in resources.files(__name__).iterdir():
        if file.name.endswith(".yaml"):
            text = file.read_text(encoding="utf-8")
            store.store(group=GROUP, name=file.name[: -len(".yaml")], node=OmegaConf.create(text),
                        package=package_of(text), provider="rapidformer")


register()
