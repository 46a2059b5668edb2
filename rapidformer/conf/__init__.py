"""Config groups and recipes (YAML), found by Hydra as the package rapidformer.conf."""
