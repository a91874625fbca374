"""Gradient hooks the training code registered on the parameters itself, described in a bundle.

Training code edits gradients in hooks on the parameters: a clamp or a normalisation per row
(``p.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))``), and the 'optimizer step in
backward' tutorial's per-parameter optimizer stepped from
``p.register_post_accumulate_grad_hook`` (the gradient freed right after). A script registers
them after the factory built the model, so the replay's model has none; a hook is code, which
a bundle never holds. Its description is what the report can name: the function, its source
line, and, for an optimizer hook, the optimizer its closure steps for that parameter (class
and number settings: Adam's ``eps=0``). The recorder's own hooks (:class:`Hook`) are left out.
Forward hooks and pre-hooks the user put on the modules are described the same way.
"""

from __future__ import annotations

import inspect
import linecache
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compat import accumulate_hooks, forward_hooks, grad_hooks
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


def user_module_hooks(modules: list[tuple[str, nn.Module]]) -> dict[str, list[dict]]:
    """``{module name: [hook description, ...]}`` of the forward and backward hooks and
    pre-hooks the user's code put on the modules (``kind``: ``forward_pre``, ``forward``,
    ``backward_pre``, ``backward``): feature noise, an input normalisation, an activation
    capture, a ``register_full_backward_hook`` returning a new grad_input. torch's own (``prune``'s, the hook-based
    ``spectral_norm``'s and ``weight_norm``'s, which the replay rebuilds or names from the
    parameters) and the recorder's (its callbacks' too) are left out. ``before_recorder``: a
    pre-hook that runs before the recorder's on the root, whose returned inputs it records."""
    found: dict[str, list[dict]] = {}
    for name, m in modules:
        hooks = forward_hooks(m)
        ours = [i for i, (kind, fn) in enumerate(hooks)
                if kind == "forward_pre" and isinstance(fn, Hook)]
        for i, (kind, fn) in enumerate(hooks):
            if not isinstance(fn, Hook) and not _torch_own(fn):
                entry = {"kind": kind, **describe(fn)}
                # (a root pre-hook run before the recorder's: the inputs recorded are its)
                if ours and kind == "forward_pre" and i < ours[0]:
                    entry["before_recorder"] = True
                found.setdefault(name, []).append(entry)
    return found


def module_hooks_meta(modules: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """``{"user_module_hooks": ...}`` for a bundle's meta, ``{}`` when no module has any (the
    script's own, which the factory's model may lack)."""
    hooked = user_module_hooks(modules)
    return {"user_module_hooks": hooked} if hooked else {}


def _torch_own(fn: Any) -> bool:
    owner = getattr(fn, "__module__", None) or type(fn).__module__
    # (the recorder's callbacks' own; the replay's, when it describes a rebuilt model)
    return (owner or "").split(".")[0] in ("torch", "recorder", "replay")


def describe(fn: Any) -> dict[str, Any]:
    """The function's qualified name and, where Python knows it, ``file:line`` and that line."""
    fn = getattr(fn, "func", fn)  # (a functools.partial: the function it calls)
    code_of = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = getattr(inspect.unwrap(code_of), "__code__", None)
    if code is None:
        return {"name": name}
    line, text = _telling_line(code)
    return {"name": name, "source": f"{Path(code.co_filename).name}:{line}", "line": text}


def _telling_line(code) -> tuple[int, str]:
    """The line of a hook that says what it does: the first ``return`` of a value in its body
    (``return out + noise``), else its first statement (``optimizers[p].step()``); a lambda's
    own line."""
    first = code.co_firstlineno
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return first, linecache.getline(code.co_filename, first).strip()
    body = [(start + i, t.strip()) for i, t in enumerate(lines) if t.strip()]
    if not body or not body[0][1].startswith("def "):
        return first, body[0][1] if body else ""
    stmts = [(n, t) for n, t in body[1:] if not t.startswith(("#", '"""', "'''"))]
    returns = [(n, t) for n, t in stmts if t.startswith("return ") and t != "return None"]
    return (returns or stmts or body)[0]


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
