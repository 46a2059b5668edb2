"""Hydra's own command-line flags, told apart from the overrides beside them (the Hydra entry,
the console script and the verbs all read the same command lines)."""
from __future__ import annotations

# Hydra's own flags that may appear in a forwarded command line
HYDRA_FLAGS = {"--cfg", "-c", "--resolve", "--package", "-p", "--help", "-h", "--hydra-help",
               "--info", "-i", "--multirun", "-m", "--config-path", "-cp", "--config-name",
               "-cn", "--config-dir", "-cd", "--run", "-r", "--version",
               "--shell-completion", "-sc", "--experimental-rerun"}
# Hydra flags that take a value in the next argument
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp",
                          "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra flags, overrides)."""
    flags, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-"):
            flags.append(arg)
            takes_value = arg in HYDRA_FLAGS_WITH_VALUE or (
                arg in ("--info", "-i") and i + 1 < len(argv) and argv[i + 1] in _INFO_CHOICES)
            if takes_value and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides
