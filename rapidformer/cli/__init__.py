"""The command line: `python -m rapidformer` (Hydra: recipes, groups, overrides, sweeps), the
`rapidformer` console script (the seed's flags and the verbs), and the workers' entry."""
