"""Typed configs: schemas, composition, validation and the seed-named view (`get_args`)."""
from rapidformer.config.schema import RunConfig

__all__ = ["RunConfig"]
