"""The paths a run's config names, read from another folder than the one the run started in:
a relative path (data.path=data, from the command line or from a recipe) means the folder the
run started in (Hydra records it, .hydra/hydra.yaml's runtime.cwd). The commands rapidformer
prints for a run (resume) and the verbs that read a run's config (eval, predict, generate)
anchor such paths there, so they run from any folder."""
from __future__ import annotations

import glob
from pathlib import Path

import yaml

# the config's keys that may name a file or folder the run reads
PATH_KEYS = ("data.path", "model.name_or_path", "model.tokenizer", "model.merge_file",
             "model.init_from_hf", "data.chat_template", "user_script")


def started_in(run_dir: Path) -> Path | None:
    """The folder the run in `run_dir` was started in, as Hydra recorded it (None: unknown)."""
    try:
        hydra = yaml.safe_load((Path(run_dir) / ".hydra" / "hydra.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    cwd = ((hydra.get("hydra") or {}).get("runtime") or {}).get("cwd")
    return Path(cwd) if isinstance(cwd, str) and cwd else None


def names_a_path(text: str, start: Path) -> bool:
    """Whether `text` is a relative path that names something in `start` (a file, a folder, a
    glob's match, or a Megatron data prefix: DIR/corpus_text_document for its .bin and .idx)."""
    if not text or Path(text).is_absolute() or "," in text or text.startswith(("${", "[")) \
            or "\n" in text:
        return False
    named = start / text
    if any(c in text for c in "*?["):
        return bool(glob.glob(str(named)))
    return named.exists() or any(Path(f"{named}{ext}").is_file() for ext in (".bin", ".idx"))


def anchored(plain: dict, start: Path | None) -> dict[str, str]:
    """{key: the absolute path} of each of the config's PATH_KEYS whose value is a relative
    path naming something in `start`."""
    if start is None:
        return {}
    out = {}
    for key in PATH_KEYS:
        node = plain
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and names_a_path(node, start):
            out[key] = str(start / node)
    return out


def with_anchored_paths(plain: dict, run_dir: Path) -> dict:
    """`plain` (a run's resolved config) with its relative paths made absolute in the folder
    the run started in."""
    for key, path in anchored(plain, started_in(run_dir)).items():
        *parents, last = key.split(".")
        node = plain
        for part in parents:
            node = node[part]
        node[last] = path
    return plain
