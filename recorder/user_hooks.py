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

import ast
import inspect
import linecache
import math
import textwrap
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compat import accumulate_hooks, forward_hooks, grad_hooks
from .hook_values import filled, nonfinite_values
from .hooks import Hook
from .unhooked_call import unwrapped

KINDS = (("tensor", grad_hooks), ("post_accumulate", accumulate_hooks))


def user_grad_hooks(params: list[tuple[str, torch.Tensor]]) -> dict[str, list[dict]]:
    """``{parameter name: [hook description, ...]}`` of the parameters that carry hooks of the
    user's (``kind``: ``tensor`` or ``post_accumulate``; ``name``, ``source``, ``line``;
    ``optimizer``: the class and settings of an optimizer the hook's closure holds for it).
    ``{}`` if describing them fails: a description never costs the bundle."""
    try:
        return _user_grad_hooks(params)
    except Exception:  # (user objects of any kind: a failure here must not lose the bundle)
        return {}


def _user_grad_hooks(params: list[tuple[str, torch.Tensor]]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for name, p in params:
        for kind, of in KINDS:
            for fn in of(p):
                if not _users(fn):
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
            if _users(fn):
                entry = {"kind": kind, **describe(fn)}
                # (a root pre-hook run before the recorder's: the inputs recorded are its)
                if ours and kind == "forward_pre" and i < ours[0]:
                    entry["before_recorder"] = True
                found.setdefault(name, []).append(entry)
    return found


def rewriting_pre_hooks(modules: list[tuple[str, nn.Module]]) -> set[int]:
    """The positions in ``modules`` (the root's aside) of those with a forward pre-hook of the
    user's that returns new inputs (``x / running_std``): the recorder reads a call's inputs
    as the pre-hooks left them, so a non-finite value one made looks given to the call."""
    try:
        hooked = user_module_hooks(modules[1:])
    except Exception:  # (at an event: never at the bundle's cost)
        return set()
    return {i for i, (name, _) in enumerate(modules) if i and any(
        h["kind"] == "forward_pre" and h.get("returns") for h in hooked.get(name, ()))}


def module_hooks_meta(modules: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """``{"user_module_hooks": ...}`` for a bundle's meta, ``{}`` when no module has any (the
    script's own, which the factory's model may lack)."""
    try:
        hooked = user_module_hooks(modules)
    except Exception:  # (as in user_grad_hooks: never at the bundle's cost)
        return {}
    return {"user_module_hooks": hooked} if hooked else {}


def _users(fn: Any) -> bool:
    """Whether ``fn`` is a hook of the training code's: not the recorder's, not torch's own,
    not an installed library's (Opacus's per-sample gradient capture: what a library registers
    it registers again around the factory's model), nor the replay's on a rebuilt model."""
    if isinstance(fn, Hook):
        return False
    fn = getattr(fn, "func", fn)
    owner = getattr(fn, "__module__", None) or type(fn).__module__
    if (owner or "").split(".")[0] in ("torch", "recorder", "replay"):
        return False
    code = _code(fn)
    parts = Path(code.co_filename).parts if code is not None else ()
    return not {"site-packages", "dist-packages"} & set(parts)


def describe(fn: Any) -> dict[str, Any]:
    """The function's qualified name and, where Python knows it, ``file:line`` and that line."""
    fn = getattr(fn, "func", fn)  # (a functools.partial: the function it calls)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    code = _code(fn)
    if code is None:
        return {"name": name}
    line, text, returns = _telling_line(code)
    held = nonfinite_values(fn)  # (a gradient reversal's lambda a schedule made NaN)
    return {"name": name, "source": f"{Path(code.co_filename).name}:{line}", "line": text,
            **({} if returns is None else {"returns": returns}),
            **({"nonfinite": held} if held else {})}


def _code(fn: Any):
    """The code object a hook runs: a function's or method's own, else its class's
    ``__call__`` (a callable object), through any ``functools.wraps`` chain; None if none."""
    code_of = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
    return getattr(unwrapped(code_of), "__code__", None)


def _telling_line(code) -> tuple[int, str, bool | None]:
    """The line of a hook that says what it does: the first ``return`` of a value in its body
    (``return out + noise``), else its first statement after a docstring
    (``optimizers[p].step()``); a lambda's own line. And whether it returns a value (one that
    replaces what the hook was given: a rewritten grad_input), None when unknown."""
    first = code.co_firstlineno
    own = (first, linecache.getline(code.co_filename, first).strip(),
           True if code.co_name == "<lambda>" else None)
    try:
        lines, start = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):  # (a lambda amid a call's arguments)
        return own
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return own
    body = fn.body[1:] if len(fn.body) > 1 and isinstance(fn.body[0], ast.Expr) and \
        isinstance(fn.body[0].value, ast.Constant) else fn.body  # (a docstring)
    returns = [n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Return)
               and n.value is not None and not (isinstance(n.value, ast.Constant)
                                                and n.value.value is None)]
    node = (returns or body or [fn])[0]
    line = start + node.lineno - 1
    return line, linecache.getline(code.co_filename, line).strip(), bool(returns)


def closure_optimizer(fn: Any, p: torch.Tensor) -> dict[str, Any] | None:
    """The optimizer a hook's closure holds for ``p`` (one per parameter in a dict or a list,
    or one over all of them): its class and the number settings of ``p``'s group."""
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if filled(c)]
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
