"""The root config and the config groups (YAML), found by Hydra as the package rapidformer.conf.

Importing it registers the recipes (the package rapidformer.recipes) as the group `recipe`.
"""
import rapidformer.recipes  # noqa: F401
