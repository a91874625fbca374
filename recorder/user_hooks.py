"""Gradient hooks the training code registered on the parameters itself, described in a bundle.

Training code edits gradients in hooks on the parameters: a clamp or a normalisation per row
(``p.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))``), and the 'optimizer step in
backward' tutorial's per-parameter optimizer stepped from
``p.register_post_accumulate_grad_hook`` (the gradient freed right after). A script registers
them after the factory built the model, so the replay's model has none; a hook is code, which
a bundle never holds. Its description is what the report can name: the function, its source
line, and, for an optimizer hook, the optimizer its closure steps for that parameter (class
and number settings: Adam's ``eps=0``). The recorder's own hooks (:class:`Hook`) are left out.
"""

from __future__ import annotations

import inspect
import linecache
import math
from pathlib import Path
from typing import Any

import torch

from .compat import accumulate_hooks, grad_hooks
from .hooks import Hook

KINDS = (("tensor", grad_hooks), ("post_accumulate", accumulate_hooks))


def user_grad_hooks(params: list[tuple[str, torch.Tensor]]) -> dict[str, list[dict]]:
    """``{parameter name: [hook description, ...]}`` of the parameters that carry hooks of the
    user's (``kind``: ``tensor`` or ``post_accumulate``; ``name``, ``source``, ``line``;
    ``optimizer``: the class and settings of an optimizer the hook's closure holds for it)."""
    found: dict[str, list[dict]] = {}
    for name, p in params:
        for kind, of in KINDS:
            for fn in of(p):
                if isinstance(fn, Hook):
                    continue
                entry = {"kind": kind, **describe(fn)}
                if kind == "post_accumulate" and (opt := closure_optimizer(fn, p)):
                    entry["optimizer"] = opt
                found.setdefault(name, []).append(entry)
    return found


def describe(fn: Any) -> dict[str, Any]:
    """The function's qualified name and, where Python knows it, ``file:line`` and that line."""
    fn = getattr(fn, "func", fn)  # (a functools.partial: the function it calls)
    code_of = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(inspect.unwrap(code_of), "__code__", None)
    if code is None:
        return {"name": name}
    line = code.co_firstlineno
    text = linecache.getline(code.co_filename, line).strip()
    if text.startswith("def ") and not name.endswith("<lambda>"):  # (the body's first line)
        body = linecache.getline(code.co_filename, line + 1).strip()
        if body and not body.startswith(('"""', "'''")):
            line, text = line + 1, body
    return {"name": name, "source": f"{Path(code.co_filename).name}:{line}", "line": text}


def closure_optimizer(fn: Any, p: torch.Tensor) -> dict[str, Any] | None:
    """The optimizer a hook's closure holds for ``p`` (one per parameter in a dict or a list,
    or one over all of them): its class and the number settings of ``p``'s group."""
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if _filled(c)]
    for value in cells:
        many = value.values() if isinstance(value, dict) else value \
            if isinstance(value, (list, tuple)) else (value,)
        for opt in many:
            if isinstance(opt, torch.optim.Optimizer):
                group = next((g for g in opt.param_groups
                              if any(q is p for q in g["params"])), None)
                if group is not None:
                    return {"class": type(opt).__qualname__, "settings": {
                        k: v for k, v in group.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v)}}
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
