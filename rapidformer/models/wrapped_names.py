"""Parameter and buffer names as the bare model has them, from a wrapped model's."""
from __future__ import annotations

# what wrappers put before a parameter's name (DDP, torch.compile, FSDP1-style)
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def bare_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
