"""The Hugging Face hub, asked only when it can answer.

Without network, transformers and datasets retry the hub for about 25 s per file before they
fall back to the cache, printing each warning twice on the way. A run that needs the hub
(a pretrained model or tokenizer named, not a folder; a hub dataset) probes the hub's host once
(a TCP connect, `PROBE_TIMEOUT` seconds) and, when it cannot be reached, runs offline from the
start (HF_HUB_OFFLINE=1 and its kin, which the job's worker processes inherit), saying so in
one line. A model then missing from the cache is refused before the run directory exists.
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from rapidformer.errors import InputError

PROBE_TIMEOUT = 2.0
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
TRUE = {"1", "true", "yes", "on"}


def offline_requested() -> bool:
    return any(os.environ.get(name, "").strip().lower() in TRUE for name in OFFLINE_VARIABLES)


def _is_local(path: str | None) -> bool:
    return bool(path) and Path(path).expanduser().exists()


def hub_models(cfg) -> list[str]:
    """The hub names of models and tokenizers this run loads (local folders left out)."""
    m = cfg.model
    names = []
    if m.source == "pretrained" and m.name_or_path and not _is_local(m.name_or_path):
        names.append(m.name_or_path)
    if m.tokenizer and not _is_local(m.tokenizer) and m.tokenizer not in names \
            and not m.tokenizer.endswith((".txt", ".json")):
        names.append(m.tokenizer)
    return names


def needs_hub(cfg) -> bool:
    return bool(hub_models(cfg)) or cfg.data.source == "hub"


def hub_reachable(timeout: float = PROBE_TIMEOUT) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """Offline for this process and the ones it starts; the libraries read the variables at
    import, so those already imported are told too."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True


def in_cache(name: str) -> bool:
    """Whether a snapshot of the hub model `name` is in the local Hugging Face cache."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def prepare(cfg) -> None:
    """Before the run: offline when the hub is out of reach, and every hub model it needs in
    the cache then (else InputError, with the fix)."""
    if not needs_hub(cfg):
        return
    if not offline_requested():
        if hub_reachable():
            return
        go_offline()
        print(f"rapidformer: the Hugging Face hub ({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}) "
              f"cannot be reached: running offline, from local folders and the cache "
              f"(HF_HUB_OFFLINE=1 skips this check)", file=sys.stderr)
    from rapidformer.data.tokenizers import unreachable_model_message

    for name in hub_models(cfg):
        if not in_cache(name):
            what = "model" if name == cfg.model.name_or_path else "tokenizer"
            raise InputError(unreachable_model_message(name, what))
