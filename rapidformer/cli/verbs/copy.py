"""`rapidformer cp RECIPE DEST`: start a recipe of your own from a shipped one (torchtune's
`tune cp`), in the folder layout `--config-dir` reads.

    rapidformer cp bert_mrpc my_configs                          # my_configs/recipe/my_bert_mrpc.yaml
    rapidformer cp bert_mrpc my_configs/recipe/mrpc_long.yaml    # that file, recipe mrpc_long
    rapidformer cp model/bert_tiny my_configs                    # my_configs/model/my_bert_tiny.yaml

It prints the command that runs the copy. A copy never replaces a file (--force does), and
never takes a shipped option's name: Hydra cannot compose two options of one name.
"""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from rapidformer.config.compose import OPTION_GROUPS, option_text, shipped_options
from rapidformer.errors import InputError

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _source(text: str) -> tuple[str, str]:
    """(group, option) of `RECIPE` or `GROUP/OPTION`."""
    group, _, option = text.rpartition("/")
    group = group or "recipe"
    if group not in OPTION_GROUPS:
        raise InputError(f"{text}: '{group}' is not a config group; give a recipe name or "
                         f"GROUP/OPTION with GROUP one of {', '.join(OPTION_GROUPS)}")
    options = shipped_options(group)
    if option not in options:
        raise InputError(f"{text}: no such {group}; choose one of {', '.join(options)} "
                         f"(rapidformer ls lists them)")
    return group, option


def _destination(dest: Path, group: str, option: str) -> tuple[Path, Path, str]:
    """(file, config folder, new option name)."""
    if dest.suffix in (".yaml", ".yml"):
        if dest.parent.name != group:
            raise InputError(
                f"{dest}: a {group} option lives in a folder named {group}/ inside the config "
                f"folder that --config-dir names (e.g. my_configs/{group}/{dest.stem}.yaml); "
                f"or give just the config folder")
        return dest, dest.parent.parent, dest.stem
    name = f"my_{option}"
    return dest / group / f"{name}.yaml", dest, name


def _renamed(text: str, group: str, old: str, new: str, folder: Path) -> str:
    """The copy under its new name: a recipe's `recipe:` line and a group option's `name:`
    line are what the run records, and the header's commands run the copy."""
    key = "recipe" if group == "recipe" else "name"
    text = re.sub(rf"^{key}: {re.escape(old)}\s*$", f"{key}: {new}", text, count=1,
                  flags=re.MULTILINE)
    selector = f"+recipe={old}" if group == "recipe" else f"{group}={old}"
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            break
        lines[i] = re.sub(rf"python -m rapidformer (.*){re.escape(selector)}\b",
                          lambda m: f"python -m rapidformer --config-dir {folder} {m.group(1)}"
                                    f"{selector.split('=')[0]}={new}", line)
    return "".join(lines)


def cp_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer cp", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a recipe (bert_mrpc) or GROUP/OPTION (model/bert_tiny)")
    parser.add_argument("dest", type=Path, help="a config folder, or FOLDER/GROUP/NAME.yaml")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    group, option = _source(args.source)
    file, folder, name = _destination(args.dest, group, option)
    if not NAME.fullmatch(name):
        raise InputError(f"{file}: '{name}' is not a usable option name (letters, digits, _ . -)")
    if name in shipped_options(group):
        raise InputError(f"{file}: '{name}' is the name of a shipped {group}; pick another "
                         f"name (Hydra cannot compose two {group} options of one name)")
    if file.exists() and not args.force:
        raise InputError(f"{file} exists; pick another name, or add --force to replace it")
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(_renamed(option_text(group, option), group, option, name, folder),
                    encoding="utf-8")
    print(f"wrote {file} (a copy of {group} {option}); edit it, then run:")
    # the folder absolute: the printed command runs from any folder
    where = shlex.quote(str(Path(folder).absolute()))
    selector = f"+recipe={name}" if group == "recipe" else f"{group}={name}"
    print(f"  python -m rapidformer --config-dir {where} {selector}")
    return 0
