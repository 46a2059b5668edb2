"""Every command that README.md and docs/ show runs as written, offline on a CPU, or says what
else it needs. Each `python -m rapidformer ...` and `rapidformer ...` line of a shell block
(continuations joined) is composed and validated in this process:

- a command that fails to compose must be shown failing (its block prints `rapidformer: error`);
- one that needs the Hugging Face hub (a pretrained name, a hub dataset), a GPU or an extra
  (the refusal pass refuses it here) must say so: in its own comment, the comment lines above it
  in the block, or the sentence before the block;
- a relative path it reads must exist in the repository or be made by an earlier command on
  the same page (a README step that no step before it prepares is how a new user gets stuck).

Placeholders in capitals (DIR, DATA, MODEL_DIR, HOST) and lines with `...` are templates, not
commands. Verbs that read a run directory (export, verify, plot, eval, predict) have tests of
their own; `show`, `validate` and `plan` compose their overrides here.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
COMMAND = re.compile(r"^(python -m rapidformer(?:\.cli)?|rapidformer)(\s|$)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
NEEDS_WORDS = re.compile(r"\b(GPUs?|hub|cache|needs?|pip install|extra|Slurm|cluster|nodes?|"
                         r"environment)\b")
# commands that only print a config: nothing is loaded, so nothing else is needed
PRINTS_ONLY = ("--cfg", "--print-hydra", "rapidformer show ", "rapidformer validate ")
COMPOSING_VERBS = {"show", "validate", "plan"}
PATH_KEYS = ("data.path", "model.tokenizer", "model.merge_file", "user_script",
             "model.name_or_path")


def _shell_commands(page: Path):
    """(line number, command, trailing comment, context before it, block text) per command."""
    text = page.read_text(encoding="utf-8")
    for block in FENCE.finditer(text):
        if block.group(1) not in ("bash", "sh", "console", "shell", ""):
            continue
        first = text[: block.start()].count("\n") + 2
        before = text[: block.start()].rstrip().rsplit("\n\n", 1)[-1]
        lines = block.group(2).split("\n")
        # in a block with prompts, only the prompted lines are commands (the rest is output)
        prompted = any(line.startswith("$ ") for line in lines)
        comments: list[str] = []
        i = 0
        while i < len(lines):
            number, line = first + i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            stripped = line.strip()
            if not stripped:
                comments = []  # a comment speaks for the commands up to the next blank line
                continue
            if stripped.startswith("#"):
                comments.append(stripped)
                continue
            if (prompted or not block.group(1)) and not stripped.startswith("$ "):
                continue  # output, or a plain block's diagram
            stripped = stripped[2:] if stripped.startswith("$ ") else stripped
            command, _, comment = stripped.partition(" #")
            context = " ".join([before, *comments]) if COMMAND.match(stripped) else None
            yield number, command.strip(), comment, context, block.group(2)


def _shell_lines(page: Path) -> list[str]:
    return [command for _, command, *_ in _shell_commands(page)]


def documented_commands():
    for page in PAGES:
        earlier: list[str] = []
        for number, command, comment, context, block in _shell_commands(page):
            linked = [line for name in re.findall(r"\b(\w+\.md)\b", context or "")
                      if (REPO / "docs" / name).is_file() and REPO / "docs" / name != page
                      for line in _shell_lines(REPO / "docs" / name)]
            earlier_text = " ".join([*earlier, *linked])
            earlier.append(command)  # any shell line may make what a later command reads
            if context is None or "..." in command or re.search(r"\b[A-Z]+=?\[", command):
                continue
            name = f"{page.relative_to(REPO)}:{number}"
            copies = [c for c in earlier if c.startswith("rapidformer cp ")]
            yield pytest.param(command, comment, context, block, earlier_text, copies, id=name)


def _overrides(command: str, tmp: Path) -> list[str] | None:
    """The overrides a command composes (placeholders made folders under `tmp`), or None for a
    verb without a config."""
    from rapidformer.cli.console import translate
    from rapidformer.cli.hydra_main import split_argv
    from rapidformer.config.search import take_config_dirs

    args = shlex.split(command)
    head = 3 if args[:2] == ["python", "-m"] else 1
    args = args[head:]
    if args and args[0] in COMPOSING_VERBS:
        args = args[1:]
    elif args and not args[0].startswith(("-", "+")) and "=" not in args[0]:
        return None  # ls, env, export, verify, plot, cp, eval, predict: no config to compose
    if command.startswith("rapidformer"):
        for arg in args:  # the seed's --data-path is read by whether the folder exists
            if "/" in arg and not arg.startswith("-") and not Path(arg).is_absolute() \
                    and not (REPO / arg).exists() and not PLACEHOLDER.match(arg.split("/")[0]):
                (tmp / arg).mkdir(parents=True, exist_ok=True)
        flags, overrides, _ = translate(args)
    else:
        flags, overrides = split_argv(args)
    flags, overrides = take_config_dirs(flags, overrides)
    return [_placeholder_filled(_first_of_sweep(o), tmp) for o in overrides]


def _placeholder_filled(override: str, tmp: Path) -> str:
    key, sep, value = override.partition("=")
    head, slash, rest = value.partition("/")
    if sep and PLACEHOLDER.match(head) and not key.startswith("hydra"):
        (tmp / head).mkdir(exist_ok=True)  # a local folder, as the user's would be
        return f"{key}={tmp / head}{slash}{rest}"
    return override


def _first_of_sweep(override: str) -> str:
    key, sep, value = override.partition("=")
    if sep and "," in value and not value.startswith(("[", "'", '"')) and key != "data.split":
        return f"{key}={value.split(',')[0]}"
    return override


def _path_made_before(value: str, earlier: str) -> bool:
    if PLACEHOLDER.match(value.split("/")[0]) or Path(value).is_absolute():
        return True
    if (REPO / value).exists():
        return True
    words = set(re.split(r"[\s=]+", earlier))
    top = value.split("/")[0]
    return top in words or any(value.startswith(w) and len(w) > 3 for w in words if "/" in w)


@pytest.mark.parametrize("command, comment, context, block, earlier, copies",
                         list(documented_commands()))
def test_documented_command(command, comment, context, block, earlier, copies, tmp_path,
                            monkeypatch):
    import torch

    from rapidformer.config import search
    from rapidformer.config.compose import compose, with_default_recipe
    from rapidformer.errors import RapidformerError
    from rapidformer.preflight import check_environment, settle
    from rapidformer.runtime import hub

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine
    for example in ("examples",):  # what the commands name in the repository
        (tmp_path / example).symlink_to(REPO / example)
    monkeypatch.chdir(tmp_path)
    from rapidformer.cli.verbs.copy import cp_command

    for copy in copies:  # the page's `rapidformer cp` steps make the config folders it uses
        assert cp_command(shlex.split(copy)[2:]) == 0, copy
    try:
        overrides = _overrides(command, tmp_path)
        if overrides is None:
            return
        shown_failing = "rapidformer: error" in block or "rapidformer validate" in command
        try:
            plain, cfg = settle(compose(with_default_recipe(overrides), default_recipe=False),
                                str(tmp_path))
        except RapidformerError as exc:
            assert shown_failing, f"`{command}` fails as written: {exc}"
            return
        if any(p in command for p in PRINTS_ONLY):
            return
        says = NEEDS_WORDS.search(f"{comment} {context}")
        if hub.needs_hub(cfg):
            assert says, f"`{command}` needs the Hugging Face hub (or its cache): say so"
        try:  # the run's refusal pass, this machine's part (rapidformer/preflight.py)
            check_environment(cfg)
        except RapidformerError as exc:
            assert says, f"`{command}` cannot run on a CPU here ({exc}): say what it needs"
        for key in PATH_KEYS:
            value = plain
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, str) and "/" in value and not hub.needs_hub(cfg):
                assert _path_made_before(value, earlier), \
                    f"`{command}` reads {key}={value}, which no earlier step on the page makes"
    finally:
        search.use([])
