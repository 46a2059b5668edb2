"""`python -m rapidformer.cli ...`: the `rapidformer` console script."""
from rapidformer.cli.console import main

if __name__ == "__main__":
    main()
