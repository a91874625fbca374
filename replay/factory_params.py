"""The recorded ``factory_kwargs`` a factory does not take, left out of its call.

A sweep records ``FlightRecorder(..., factory_kwargs=trial.params)``: optuna's ``trial.params``
holds every suggested value, the optimizer's (``lr``, ``weight_decay``) and the loop's
(``batch_size``) beside the model's, and a factory written for the model's settings alone
(``def build(n_layers, width, dropout)``, no ``**kwargs``) fails on the first of the others
(``TypeError: unexpected keyword argument 'lr'``). The keys that are none of its parameters
are left out of the call and said in a note; a factory with ``**kwargs`` takes them all, and
one whose signature cannot be read is called with them as recorded.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["taken_kwargs"]


def taken_kwargs(fn, kwargs: dict[str, Any], spec: str) -> tuple[dict[str, Any], str | None]:
    """(the keyword arguments ``fn`` takes, the note naming those left out, or None)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs, None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs, None
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    left = [k for k in kwargs if k not in names]
    if not left or len(left) == len(kwargs) and names:
        # (none of them its parameters: the wrong factory, whose own error says so)
        return kwargs, None
    shown = ", ".join(left[:8]) + (f" (+{len(left) - 8} more)" if len(left) > 8 else "")
    return ({k: v for k, v in kwargs.items() if k in names},
            f"factory_kwargs {shown} are no parameters of the factory {spec} and were left "
            "out of its call (a sweep's trial.params holds the optimizer's and the loop's "
            "settings beside the model's); record only the model's, or give the factory "
            "**kwargs")
