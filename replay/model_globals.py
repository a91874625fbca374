"""A loss function that calls the recorded model through a global of its module (a script's
``critic``, on which its gradient penalty runs ``autograd.grad``): imported by the replay, its
module builds its own model, another instance than the rebuilt one with the bundle's weights,
so the re-run's loss would call a model the step never ran. The recorder names those globals
(``model_globals``, see :mod:`recorder.lossdesc`); the re-run binds them to the rebuilt model
for each call of the function, and puts back what was there after."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

_UNSET = object()


def with_model_globals(fn, info: dict[str, Any], model: nn.Module | None):
    """``fn`` calling ``model`` where it reads the globals ``info["model_globals"]`` names;
    ``fn`` itself when it reads none (or there is no model, or no module scope to bind)."""
    names = [n for n in info.get("model_globals") or () if isinstance(n, str)]
    inner = fn.func if isinstance(fn, functools.partial) else fn
    scope = getattr(inner, "__globals__", None)
    if not names or model is None or not isinstance(scope, dict):
        return fn

    @functools.wraps(inner)
    def bound(*args, **kwargs):
        saved = {n: scope.get(n, _UNSET) for n in names}
        scope.update(dict.fromkeys(names, model))
        try:
            return fn(*args, **kwargs)
        finally:
            for n, v in saved.items():
                if v is _UNSET:
                    scope.pop(n, None)
                else:
                    scope[n] = v
    return bound
