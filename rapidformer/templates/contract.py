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


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def provided(instance, method: str, value, shape: str, count: int | None = None,
             check=None) -> object:
    """`value`, returned by the subclass's `method`, if it has the shape the loop needs: a
    tuple or list of `count` items (when `count` is given), passing `check(value)` (a problem
    text or None). Otherwise one message naming the method, what it returned and what it must
    return."""
    problem = None
    if count is not None and (not isinstance(value, (tuple, list)) or len(value) != count):
        problem = f"returned {_describe(value)}"
    elif check is not None:
        problem = check(value)
    if problem:
        raise RapidformerError(f"{type(instance).__name__}.{method}() {problem}; it must return "
                               f"{shape}")
    return value


def loss_problem(value) -> str | None:
    """Why `value`, returned by run_forward_step, is not a loss to call backward on."""
    import torch

    if isinstance(value, tuple) and len(value) == 2 and callable(value[1]):
        return None  # megatron-core's (output_tensor, loss_func) pair, for pipeline stages
    if not isinstance(value, torch.Tensor):
        return f"returned {_describe(value)}, not the loss tensor"
    if value.numel() != 1:
        return f"returned a tensor of shape {tuple(value.shape)}, not one loss value"
    return None


def model_problem(value) -> str | None:
    import torch

    model = value[0]
    if not isinstance(model, torch.nn.Module):
        return f"returned {type(model).__name__} as the model, not a torch.nn.Module"
    return None
