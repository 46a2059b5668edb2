"""From command-line overrides to one resolved, typed config.

Hydra composes; this module adds what Hydra does not do for us: the default recipe, a check of
every override against the schemas before Hydra sees them (so all typos are reported at once,
each with the closest valid name), and the final validation into a `RunConfig`.
"""
from __future__ import annotations

import dataclasses
import typing
from importlib import resources

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import rapidformer.config.resolvers  # noqa: F401  (registers the configs' resolvers)
from rapidformer.config.schema import GROUPS, RunConfig
from rapidformer.config.validate import build_run_config, closest, unknown_key_message
from rapidformer.errors import ConfigError, NotAvailableError

# the repository's conf/ and recipes/, installed as these packages (pyproject.toml)
CONF_PACKAGE = "rapidformer.conf"
RECIPE_PACKAGE = "rapidformer.recipes"
CONFIG_NAME = "config"
DEFAULT_RECIPE = "quickstart"
# group-like names a command line may pick an option of (`recipe` is added with `+recipe=`)
OPTION_GROUPS = GROUPS + ("recipe",)


def installed_files(package: str):
    """The files of CONF_PACKAGE or RECIPE_PACKAGE, or an error saying how to mend the install."""
    import importlib

    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError:
        raise NotAvailableError(f"{package} is not installed: reinstall rapidformer "
                                f"(pip install -e . in a checkout)") from None
    if getattr(module, "__file__", None) is None:
        raise NotAvailableError(
            f"{package} is the folder {list(module.__path__)[0]}, without __init__.py: a leftover "
            f"of the layout before conf/ and recipes/ moved to the top of the repository; delete "
            f"it, and run pip install -e . again if this checkout was installed before the move")
    return resources.files(module)


def option_folder(group: str):
    """Where a group's option files are: conf/<group>/, or recipes/ for the group `recipe`."""
    conf = installed_files(CONF_PACKAGE)  # which registers the recipes with Hydra
    return installed_files(RECIPE_PACKAGE) if group == "recipe" else conf.joinpath(group)


def group_options(group: str) -> list[str]:
    folder = option_folder(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def option_text(group: str, option: str) -> str:
    """An option's YAML file as written (its header comment included)."""
    return option_folder(group).joinpath(f"{option}.yaml").read_text(encoding="utf-8")


def _key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]


def with_default_recipe(overrides: list[str]) -> list[str]:
    """`python -m rapidformer` alone runs the quickstart: add it when no recipe is named."""
    if any(_key_of(o) == "recipe" for o in overrides):
        return list(overrides)
    return [f"+recipe={DEFAULT_RECIPE}", *overrides]


def _schema_at(path: list[str]):
    """The dataclass (or field type) that a dotted path points at, or the first bad part."""
    cls = RunConfig
    for i, part in enumerate(path):
        if cls is dict:  # a free mapping (graph.options): any key below it
            return dict, len(path)
        if not dataclasses.is_dataclass(cls):
            return None, i
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None, i
        cls = hints[part]
    return cls, len(path)


def check_overrides(overrides: list[str]) -> list[str]:
    """Refuse unknown keys and unknown group options in command-line overrides, all at once.

    Returns the overrides to give Hydra: a plain `key=value` on a schema key becomes
    `++key=value`, since an option's YAML need not list every key of its schema (Hydra would
    refuse to change a key the YAML does not have).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    problems: list[str] = []
    normalized: list[str] = []
    parser = OverridesParser.create()
    for text in overrides:
        text = _quote_split(text)
        normalized.append(text)
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as exc:
            problems.append(f"cannot parse override '{text}': {str(exc).splitlines()[0]}")
            continue
        key = override.key_or_group
        if key.startswith("hydra") or override.package is not None:
            continue  # Hydra's own settings: Hydra checks them
        if key in OPTION_GROUPS:
            if override.is_delete():
                continue
            available = group_options(key)
            values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                      else [override.value()])
            for value in values:
                _require_plugin(key, str(value))
                if str(value) not in available:
                    hint = closest(str(value), available)
                    tip = f"did you mean '{key}={hint}'? " if hint else ""
                    problems.append(f"{key}={value}: no such option; {tip}"
                                    f"choose one of: {', '.join(available)}")
            continue
        parts = key.split(".")
        found, depth = _schema_at(parts)
        if found is None:
            parent = ".".join(parts[:depth])
            parent_cls, _ = _schema_at(parts[:depth])
            if dataclasses.is_dataclass(parent_cls):
                valid = [f.name for f in dataclasses.fields(parent_cls)]
                problems.append(unknown_key_message(parent, parts[depth], valid))
            else:
                problems.append(f"{key}: '{parent}' is a value, not a group of keys")
        elif override.type == OverrideType.CHANGE and not dataclasses.is_dataclass(found):
            normalized[-1] = f"++{text}"
    if problems:
        raise ConfigError(problems)
    return normalized


# options that compose a Hydra plugin: (group, option) -> (plugin module, how to install it)
PLUGIN_OPTIONS = {
    ("launcher", "slurm"): ("hydra_plugins.hydra_submitit_launcher",
                            "pip install 'rapidformer[slurm]'"),
    ("recipe", "quickstart_optuna"): ("hydra_plugins.hydra_optuna_sweeper",
                                      "pip install 'rapidformer[optuna]'"),
}


def _require_plugin(group: str, option: str) -> None:
    import importlib.util

    need = PLUGIN_OPTIONS.get((group, option))
    if need and importlib.util.find_spec(need[0]) is None:
        raise NotAvailableError(f"{group}={option} needs the Hydra plugin {need[0]}: {need[1]}")


def _quote_split(text: str) -> str:
    """`data.split=980,20` as Megatron writes it: Hydra would read the comma as a sweep over two
    values, so a bare split value is quoted (a split is one string, never swept)."""
    key, sep, value = text.partition("=")
    if sep and key.lstrip("+") == "data.split" and "," in value and value[:1] not in "'\"":
        return f"{key}='{value}'"
    return text


def compose(overrides: list[str] | None = None, default_recipe: bool = True) -> DictConfig:
    """The composed (unresolved) config for these overrides, through Hydra's Compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException

    overrides = list(overrides or [])
    if default_recipe:
        overrides = with_default_recipe(overrides)
    overrides = check_overrides(overrides)
    installed_files(CONF_PACKAGE)  # a broken install says how to mend it, before Hydra's error
    try:
        with initialize_config_module(config_module=CONF_PACKAGE, version_base="1.3"):
            return hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([str(exc).strip().splitlines()[0]]) from exc


def resolve(cfg: DictConfig, output_dir: str | None = None) -> tuple[dict, RunConfig]:
    """Resolve interpolations once and validate: (plain dict for the record, typed config).
    Config is data here: memory=auto is left for the factory's planning step to decide."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    cfg.pop("hydra", None)
    if output_dir is not None:
        cfg.trainer.output_dir = output_dir
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = str(exc).strip().splitlines()[0]
        if "Missing mandatory value" in msg and key:
            raise ConfigError([f"{key} must be set (it is ??? in its config file); e.g. {key}=VALUE"]) from exc
        raise ConfigError([f"{key or 'config'}: {msg}"]) from exc
    return plain, build_run_config(plain)

