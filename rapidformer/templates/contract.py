"""The template's methods a subclass overrides must keep their call shape: the loop calls
`run_forward_step(batch, model)`, so an override taking `(self, batch)` would fail deep inside
the first step with a TypeError. Checked when the template is built, before any work."""
from __future__ import annotations

import inspect

from rapidformer.errors import RapidformerError


def _positional(function) -> tuple[int, int, bool]:
    """(positional parameters after self, how many of them are required, whether it takes
    *args)."""
    params = list(inspect.signature(function).parameters.values())[1:]
    kinds = inspect.Parameter
    count = sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD) for p in params)
    required = sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
                   and p.default is inspect.Parameter.empty for p in params)
    return count, required, any(p.kind == kinds.VAR_POSITIONAL for p in params)


def check_overrides(instance, template: type, names: tuple[str, ...]) -> None:
    """Refuse an override that cannot be called the way `template`'s loop calls it."""
    cls = type(instance)
    for name in names:
        mine, theirs = getattr(cls, name, None), getattr(template, name)
        if mine is None or mine is theirs or not callable(mine):
            continue
        expected = len(inspect.signature(theirs).parameters) - 1
        count, required, varargs = _positional(mine)
        if required <= expected and (count >= expected or varargs):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        raise RapidformerError(
            f"{owner.__name__}.{name}{inspect.signature(mine)} does not match the template's "
            f"{name}{inspect.signature(theirs)}: the {template.__name__} loop calls it with "
            f"{expected} argument(s); change the method's parameters to match")
