"""`python -m rapidformer [+recipe=NAME] [group=option ...] [key=value ...]`: see
rapidformer.cli.hydra_main. `python -m rapidformer VERB ...` is `rapidformer VERB ...`
(rapidformer/cli/verbs), for an environment whose scripts are not on the PATH."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from rapidformer.cli.console import TRAIN_VERBS
    from rapidformer.cli.verbs import VERBS

    if args and args[0] in (*VERBS, *TRAIN_VERBS):
        from rapidformer.cli.console import main as console_main

        return console_main(args)
    from rapidformer.cli.hydra_main import main as hydra_main

    return hydra_main(argv)


if __name__ == "__main__":
    main()
