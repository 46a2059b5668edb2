"""`python -m rapidformer [+recipe=NAME] [group=option ...] [key=value ...]`: see
rapidformer.cli.hydra_main."""
from rapidformer.cli.hydra_main import main

if __name__ == "__main__":
    main()
