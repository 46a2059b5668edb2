"""From command-line overrides to one resolved, typed config.

Hydra composes; this module adds what Hydra does not do for us: the default recipe, a check of
every override against the schemas before Hydra sees them (so all typos are reported at once,
each with the closest valid name), after composing a refusal of the overrides that the options
picked would not read (read_keys.USED_ONLY_WITH) and a fix for `+` on a key that is there, and the
final validation into a `RunConfig`.
"""
from __future__ import annotations

import dataclasses
import typing
from importlib import resources

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import rapidformer.config.resolvers  # noqa: F401  (registers the configs' resolvers)
from rapidformer.config import search
from rapidformer.config.schema import GROUPS, RunConfig
from rapidformer.config.bounds import schema_default
from rapidformer.config.read_keys import USED_ONLY_WITH
from rapidformer.config.typed import closest, unknown_key_message
from rapidformer.config.validate import build_run_config
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


def shipped_options(group: str) -> list[str]:
    folder = option_folder(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def group_options(group: str) -> list[str]:
    """The group's options: rapidformer's, and those in the user's config folders
    (config/search.py), whose names must differ (Hydra cannot compose two of one name)."""
    shipped = shipped_options(group)
    own = search.user_options(group)
    clashes = sorted(set(own) & set(shipped))
    if clashes:
        raise ConfigError([f"{own[name]} has the name of rapidformer's {group} option "
                           f"'{name}': rename the file (e.g. my_{name}.yaml; `rapidformer cp` "
                           f"writes copies under a new name)" for name in clashes])
    return sorted({*shipped, *own})


def option_text(group: str, option: str) -> str:
    """An option's YAML file as written (its header comment included)."""
    own = search.user_options(group).get(option)
    if own is not None:
        return own.read_text(encoding="utf-8")
    return option_folder(group).joinpath(f"{option}.yaml").read_text(encoding="utf-8")


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]


# naming one of these says what to run: the quickstart's settings would then be a surprise
# (a white-box script that trains 4 epochs because the quickstart does)
CHOOSES_THE_RUN = ("recipe", "user_script", "task")


def with_default_recipe(overrides: list[str]) -> list[str]:
    """`python -m rapidformer` alone runs the quickstart: it is added when the command names
    no recipe, no user script and no task; otherwise the groups' defaults apply."""
    if any(override_key(o) in CHOOSES_THE_RUN for o in overrides):
        return list(overrides)
    return [f"+recipe={DEFAULT_RECIPE}", *overrides]


def recipe_line(overrides: list[str]) -> str:
    """What a run prints first: the recipe it uses, or that it uses none (overrides after
    with_default_recipe)."""
    named = [o.split("=", 1)[1] for o in overrides if override_key(o) == "recipe" and "=" in o
             and not o.startswith("~")]
    if named and overrides[0] == f"+recipe={DEFAULT_RECIPE}" and \
            not any(override_key(o) == "recipe" for o in overrides[1:]):
        return (f"recipe: {DEFAULT_RECIPE} (the default: the command names no recipe, task or "
                f"user_script)")
    if named:
        own = search.user_options("recipe").get(named[-1])
        return f"recipe: {named[-1]}" + (f" ({own})" if own else "")
    return ("recipe: none (a task or user_script is named: the config groups' defaults, "
            "conf/, and the command's overrides)")


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


# what Hydra's override grammar reads in an unquoted value: a value holding one (a path with a
# comma, an accent, brackets) is written quoted
SPECIAL = set(",=()[]{}<>'\"\\*?|&;`!#")


def quoting_advice(text: str, special: str = "") -> str:
    """How to write `text` so that its value is read as it is."""
    key, sep, value = text.partition("=")
    found = sorted({c for c in value if c in SPECIAL or not c.isascii()} | set(special))
    if not sep or not found or value[:1] in "'\"":
        return ""
    shown = " ".join(found)
    inner = value.replace("\\", "\\\\").replace("'", "\\'")
    quoted = f"'{inner}'"
    field = _schema_at(key.lstrip("+~").split("."))[0]
    if list[str] in (field, *typing.get_args(field)):
        quoted = f"[{quoted}]"  # a list's one item (a bare quoted string is no list)
    return (f"; its value holds characters the override syntax reads itself ({shown}): quote "
            f"the value, e.g. \"{key}={quoted}\" in a shell")


def override(key: str, value) -> str:
    """`key=value` as an override that Hydra reads back as `value` (quoted where the value holds
    what the override syntax reads itself): what a printed command writes."""
    text = str(value)
    # a space is Hydra's as it is (the shell's quoting covers it); an empty value is quoted
    if not any(c in SPECIAL or not c.isascii() for c in text) and text:
        return f"{key}={text}"
    return f"{key}='" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def check_overrides(overrides: list[str], multirun: bool = False) -> list[str]:
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
            problems.append(f"cannot parse override '{text}': {str(exc).splitlines()[0]}"
                            + quoting_advice(text))
            continue
        key = override.key_or_group
        if key.startswith("hydra") or override.package is not None:
            continue  # Hydra's own settings: Hydra checks them
        if override.is_sweep_override() and not multirun and key not in OPTION_GROUPS:
            bare, _, value = text.lstrip("+").partition("=")
            problems.append(f"{text.lstrip('+')}: a comma (or a range) makes a list of values, "
                            f"which only a sweep takes: add -m to run a job for each, or quote "
                            f"a value that holds a comma, e.g. \"{bare}='{value}'\" in a shell")
            continue
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
                    own = ("; a recipe of your own: --config-dir DIR with DIR/recipe/NAME.yaml "
                           "(`rapidformer cp RECIPE DIR` starts one from a shipped recipe)"
                           if key == "recipe" and not search.folders() else "")
                    problems.append(f"{key}={value}: no such option; {tip}"
                                    f"choose one of: {', '.join(available)}{own}")
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


def parse_override(override: str):
    """One override as Hydra reads it from the command line (a Megatron split quoted first)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([_quote_split(override)])[0]


# what _plain gives for a value it cannot resolve, and a select for a key that is not there
_UNRESOLVED = object()


def _plain(cfg: DictConfig, key: str):
    """The value at `key`, resolved to plain data (_UNRESOLVED where it cannot be)."""
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=True)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        return value
    except OmegaConfBaseException:
        return _UNRESOLVED


def options_with(group: str, key: str, values) -> list[str]:
    """The options of `group` whose file sets `key` to one of `values` (`name`: the options)."""
    found = []
    for option in group_options(group):
        if key == "name":
            chosen = option
        else:
            chosen = OmegaConf.create(option_text(group, option)).get(key)
        if chosen in values:
            found.append(option)
    return found


def _picked(cfg: DictConfig, selector: str) -> str:
    """How a message names the selected option, e.g. `memory=none` or
    `data.source=synthetic (data=synthetic_pairs)`."""
    group, key = selector.split(".", 1)
    value = _plain(cfg, selector)
    if key == "name":
        return f"{group}={value}"
    return f"{selector}={value} ({group}={_plain(cfg, f'{group}.name')})"


def _either(items) -> str:
    items = list(items)
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else items[0]


def _users(selector: str, values: tuple[str, ...]) -> str:
    """How a message names the options that read a key, e.g. `memory=zero1, zero2 or fsdp`."""
    group, key = selector.split(".", 1)
    if key == "name":
        return f"{group}={_either(values)}"
    text = f"{selector}={_either(values)}"
    options = options_with(group, key, values)
    return text + (f" ({group}={', '.join(options)})" if options else "")


# the settings the memory plan prints with each mode (planning/memory_plan.py: Mode.overrides)
PLANNED_KEYS = ("memory.offload_optimizer", "memory.offload_params")


def ignored_override_problems(overrides: list[str], cfg: DictConfig) -> list[str]:
    """Overrides of keys that the options picked do not read (read_keys.USED_ONLY_WITH): each
    would be dropped without a word, whatever its value (`peft.r=8` with peft=none). The
    memory plan's own settings set to their default are let through (`rapidformer plan` prints
    them for every mode, `memory.offload_params=false` for one that does not offload); keys
    that recipes and option files set are theirs, not the user's, and are not looked at."""
    if _plain(cfg, "user_script"):
        return []  # a white-box script may read any key
    problems = []
    for text in overrides:
        key = override_key(text)
        used = next((USED_ONLY_WITH[k] for k in (key, ".".join(key.split(".")[:2]))
                     if k in USED_ONLY_WITH), None)
        if used is None or text.lstrip().startswith("~"):
            continue
        selector, values = used
        picked = _plain(cfg, selector)
        top = ".".join(key.split(".")[:2])
        if picked is _UNRESOLVED or picked in values or (
                top in PLANNED_KEYS and _plain(cfg, top) == schema_default(top)):
            continue
        what = "it" if len(values) == 1 else "one of those"
        problems.append(f"{text.lstrip('+')} has no effect with {_picked(cfg, selector)}; it is "
                        f"used by {_users(selector, values)}: choose {what} or drop the override")
    return problems


def _existing_key_problems(overrides: list[str], compose_without) -> list[str]:
    """`+key=value` for keys the config already has: Hydra refuses them, by the first one's
    name only and without saying what to write instead."""
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    adds = [o for o in overrides if not o.startswith("++") and o.startswith("+")
            and override_key(o) not in OPTION_GROUPS and parse_override(o).type == OverrideType.ADD]
    if not adds:
        return []
    try:
        base = compose_without([o for o in overrides if o not in adds])
    except (HydraException, OmegaConfBaseException):  # the others fail too: Hydra's message
        return []
    problems = []
    for text in adds:
        key = override_key(text)
        if OmegaConf.select(base, key, default=_UNRESOLVED, throw_on_missing=False) \
                is not _UNRESOLVED:
            value = text.split("=", 1)[1] if "=" in text else ""
            problems.append(f"{key} already exists in the config: write {key}={value} (no '+'); "
                            f"'+' adds a key that is not there")
    return problems


def compose(overrides: list[str] | None = None, default_recipe: bool = True) -> DictConfig:
    """The composed (unresolved) config for these overrides, through Hydra's Compose API; an
    override that the options picked would ignore is refused here (ignored_override_problems)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException

    overrides = list(overrides or [])
    if default_recipe:
        overrides = with_default_recipe(overrides)
    overrides = check_overrides(overrides)
    installed_files(CONF_PACKAGE)  # a broken install says how to mend it, before Hydra's error
    if search.folders() and not any(override_key(o) == "hydra.searchpath" for o in overrides):
        entries = ",".join(f"'file://{d}'" for d in search.folders())
        overrides = [f"hydra.searchpath=[{entries}]", *overrides]

    def run(given: list[str]) -> DictConfig:
        with initialize_config_module(config_module=CONF_PACKAGE, version_base="1.3"):
            return hydra_compose(config_name=CONFIG_NAME, overrides=given)

    try:
        cfg = run(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        message = str(exc).strip().splitlines()[0]
        problems = _existing_key_problems(overrides, run) \
            if "Could not append to config" in message else []
        raise ConfigError(problems or [message]) from exc
    problems = ignored_override_problems(overrides, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def resolve(cfg: DictConfig, output_dir: str | None = None, check: bool = True
            ) -> tuple[dict, RunConfig]:
    """Resolve interpolations once and type: (plain dict for the record, typed config); with
    `check`, the config's own value checks too. Config is data here: memory=auto, the
    strategies' and transforms' refusals and the machine are the refusal pass's
    (rapidformer/preflight.py)."""
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
    run_cfg = build_run_config(plain, check=check)
    # the sizes decided on this machine (config/sizes.py) go into the record as numbers
    plain.setdefault("launcher", {})["nproc_per_node"] = run_cfg.launcher.nproc_per_node
    plain.setdefault("trainer", {})["global_batch_size"] = run_cfg.trainer.global_batch_size
    return plain, run_cfg

