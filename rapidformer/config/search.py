"""Configs from the user's own folders: `--config-dir DIR` (or `hydra.searchpath=[DIR]`) with
Hydra's layout, DIR/recipe/NAME.yaml for recipes and DIR/<group>/NAME.yaml for group options.

    rapidformer cp bert_mrpc my_configs          # my_configs/recipe/my_bert_mrpc.yaml
    python -m rapidformer --config-dir my_configs +recipe=my_bert_mrpc

Both spellings become one `hydra.searchpath` override, which Hydra's Compose API (the
validation before the run) and its command line (the run) read alike; the folders are kept
here so that the option checks (config/compose.py) know their files too.
"""
from __future__ import annotations

from pathlib import Path

from rapidformer.errors import ConfigError

CONFIG_DIR_FLAGS = ("--config-dir", "-cd")
_dirs: list[Path] = []


def folders() -> list[Path]:
    """The user's config folders of this command, in search order."""
    return list(_dirs)


def use(dirs: list[Path]) -> None:
    _dirs[:] = dirs


def _searchpath_entries(override: str) -> list[str] | None:
    key, sep, value = override.partition("=")
    if key.lstrip("+") != "hydra.searchpath" or not sep:
        return None
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    return [v.strip().strip("'\"") for v in value.split(",") if v.strip()]


def take_config_dirs(flags: list[str], overrides: list[str]) -> tuple[list[str], list[str]]:
    """(flags, overrides) with every --config-dir and hydra.searchpath folded into one
    `hydra.searchpath=[file://...]` override; the folders must exist."""
    named: list[str] = []
    kept_flags: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        name, eq, value = flag.partition("=")
        if name in CONFIG_DIR_FLAGS:
            if eq:
                named.append(value)
            elif i + 1 < len(flags):
                named.append(flags[i + 1])
                i += 1
            else:
                raise ConfigError([f"{flag} needs a folder: {flag} DIR"])
        else:
            kept_flags.append(flag)
        i += 1
    kept_overrides = []
    for override in overrides:
        entries = _searchpath_entries(override)
        if entries is None:
            kept_overrides.append(override)
            continue
        for entry in entries:
            if entry.startswith("pkg://"):
                raise ConfigError([f"hydra.searchpath={entry}: only folders are supported here "
                                   f"(file://DIR or DIR)"])
            named.append(entry[len("file://"):] if entry.startswith("file://") else entry)
    dirs = []
    for text in named:
        path = Path(text).expanduser().resolve()
        if not path.is_dir():
            raise ConfigError([f"config folder {text}: no such directory (--config-dir and "
                               f"hydra.searchpath name a folder holding recipe/NAME.yaml or "
                               f"<group>/NAME.yaml files)"])
        dirs.append(path)
    use(dirs)
    if dirs:
        entries = ",".join(f"'file://{d}'" for d in dirs)
        kept_overrides.insert(0, f"hydra.searchpath=[{entries}]")
    return kept_flags, kept_overrides


def user_options(group: str) -> dict[str, Path]:
    """option name -> file, for the group's files in the user's folders (the first wins)."""
    found: dict[str, Path] = {}
    for folder in _dirs:
        sub = folder / group
        if sub.is_dir():
            for file in sorted(sub.glob("*.yaml")):
                found.setdefault(file.stem, file)
    return found
