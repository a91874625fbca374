"""Naming the aten op that made a non-finite value, with the user's source line.

This is the only module that imports private PyTorch APIs (the dispatch mode), so a torch
upgrade touches one file. :class:`OpFinder` wraps a private ``TorchDispatchMode`` subclass:
inside it every aten op is checked, before it runs, for finite inputs and, after, for its
output. Two offenders are kept:

- the first op with all-finite inputs and a non-finite output (``first``), unless the
  infinity is intentional: a literal +-inf argument (``masked_fill(mask, -inf)``, ``full``) or
  an op inside a module allowed to hold infinities; those are remembered as the chain's start;
- the first op with NaN-free inputs and a NaN output (``first_nan``): the op that turned
  infinities, intentional or not, into NaN (``inf - inf``, ``0 * inf``, softmax of a -inf row).
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIRS = tuple(os.path.dirname(os.path.dirname(__file__)) + os.sep + d + os.sep
                  for d in ("replay", "recorder"))
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                  "resize_", "set_"}


@dataclass
class OpHit:
    op: str  # e.g. "aten.log"
    made: str  # "nan", "+inf", "-inf"
    source: str | None  # "model.py:42"
    input_min: float | None
    input_max: float | None
    intentional: bool = False
    rows: list[int] | None = None  # non-finite rows of its output (OpFinder(batch_size=...))

    def as_json(self) -> dict[str, Any]:
        return {"op": self.op, "made": self.made, "source": self.source,
                "input_min": _num(self.input_min), "input_max": _num(self.input_max),
                "intentional": self.intentional}


def _num(x: float | None):
    if x is None:
        return None
    return x if math.isfinite(x) else repr(x)


def user_source(stack=None) -> str | None:
    """``file:line`` of the innermost frame that is neither torch nor nanreplay.

    Walking out from the op: the watcher's own frames, then torch's; the first other frame is
    the user's code that called into torch. Reaching a frame of nanreplay instead means the
    replay itself called torch there (``optimizer.step()`` of a built-in optimizer): no user
    line made the op, and the replay's callers (a test, the CLI) are not it either.
    """
    frames = stack if stack is not None else traceback.extract_stack()
    left_own = False
    for fr in reversed(frames):
        f = fr.filename
        if f.startswith(_OWN_DIRS):
            if left_own:
                return None
            continue
        left_own = True
        if f.startswith(_TORCH_DIR) or f.startswith("<"):
            continue
        if os.sep + "contextlib.py" in f or os.sep + "threading.py" in f:
            continue
        return f"{_short(f)}:{fr.lineno}"
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _kind(ts: list[torch.Tensor]) -> str | None:
    for t in ts:
        if torch.isnan(t).any():
            return "nan"
    for t in ts:
        if torch.isposinf(t).any():
            return "+inf"
        if torch.isneginf(t).any():
            return "-inf"
    return None


def _op(func, args, kwargs):
    """``func(*args, **kwargs)`` inside a dispatch mode. What it raises is the model's op failing
    (``multinomial`` on NaN probabilities), marked so a re-run does not take it for the
    replay's own error (see ``rerun.raised_by_model``)."""
    try:
        return func(*args, **kwargs)
    except Exception as e:
        e._nanreplay_op = True
        raise


def raised_by_model(e: BaseException) -> bool:
    """Whether the model's (or its loss's) own code raised ``e`` during a re-run, rather than
    the replay: an op failing inside a dispatch mode (marked by ``_op``), else the innermost
    frame outside torch is not nanreplay's."""
    if getattr(e, "_nanreplay_op", False):
        return True
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename.startswith("<"):
            continue
        return not frame.filename.startswith(_OWN_DIRS)
    return False


class _Watch(TorchDispatchMode):
    def __init__(self, finder: OpFinder):
        super().__init__()
        self.finder = finder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        f = self.finder
        if f.first is not None and f.first_nan is not None:
            return _op(func, args, kwargs)
        leaves = tree_leaves((args, kwargs))
        ins = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.numel() and not t.is_meta]
        # one reduction and one read for all inputs: min/max say NaN (propagated) and Inf too
        lo = hi = None
        in_finite = in_nan_free = True
        if ins:
            with torch.no_grad():
                ends = torch.stack([torch.stack(torch.aminmax(t.detach())).double()
                                    for t in ins]).tolist()
            in_finite = all(math.isfinite(a) and math.isfinite(b) for a, b in ends)
            in_nan_free = not any(math.isnan(a) or math.isnan(b) for a, b in ends)
            if in_nan_free:
                lo, hi = min(a for a, _ in ends), max(b for _, b in ends)
        out = _op(func, args, kwargs)
        name = func.overloadpacket.__name__
        if name in _UNINITIALISED:
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                and t.is_floating_point() and t.numel()]
        if not outs:
            return out
        with torch.no_grad():  # aminmax: one pass, no temporary (isfinite().all() is slow)
            ends = torch.stack([torch.stack(torch.aminmax(t.detach())).double() for t in outs])
        if bool(torch.isfinite(ends).all()):
            return out
        made = _kind(outs)
        if made is None:
            return out
        op = f"aten.{name}"
        literal_inf = any(isinstance(a, float) and math.isinf(a) for a in leaves)
        intentional = literal_inf or f.in_allowed_module()
        if in_finite and f.first is None:
            hit = OpHit(op, made, user_source(), lo, hi, intentional, f.batch_rows(outs))
            if intentional:
                if f.intentional is None:
                    f.intentional = hit
            else:
                f.first = hit
        if made == "nan" and in_nan_free and f.first_nan is None:
            f.first_nan = OpHit(op, "nan", user_source(), lo, hi)
        return out


_HALF_TO_FLOAT = {"_softmax", "_log_softmax"}


class Float64(TorchDispatchMode):
    """Every aten op computes in float64: floating inputs are upcast, floating ``dtype=``
    arguments (``x.half()``, ``x.float()``, ``sum(dtype=...)``) become float64, and factory ops
    use float64 as the default dtype. Model code that casts on its own (a layer run with
    ``.half()``) then still runs in float64 instead of mixing dtypes and failing."""

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.set_default_dtype(self._default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.overloadpacket.__name__ in _HALF_TO_FLOAT and len(args) > 2:
            args = (*args[:2], False, *args[3:])
        dt = kwargs.get("dtype")
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            kwargs["dtype"] = torch.float64
        if not _mutates(func):
            args, kwargs = _upcast(args), _upcast(kwargs)
        return _op(func, args, kwargs)


_MUTATES: dict[Any, bool] = {}


def _mutates(func) -> bool:
    """In-place and out= ops write into an argument: leave their arguments as they are."""
    hit = _MUTATES.get(func)
    if hit is None:
        hit = _MUTATES[func] = any(a.alias_info is not None and a.alias_info.is_write
                                   for a in func._schema.arguments)
    return hit


def _upcast(obj):
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() and obj.dtype != torch.float64 else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_upcast(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


class OpFinder:
    """Context manager: ``with OpFinder() as f: run(); f.first, f.first_nan, f.chain()``.

    ``allowed_depth`` is raised by the caller while code of a module allowed to hold
    infinities runs, so infinities made there count as intentional.
    """

    def __init__(self, batch_size: int | None = None):
        self.first: OpHit | None = None
        self.first_nan: OpHit | None = None
        self.intentional: OpHit | None = None
        self.allowed_depth = 0
        self.batch_size = batch_size  # name the rows of the first offender's output
        self._mode = _Watch(self)

    def in_allowed_module(self) -> bool:
        return self.allowed_depth > 0

    def batch_rows(self, outs: list[torch.Tensor]) -> list[int] | None:
        """Non-finite rows (dim 0) of the first output whose dim 0 is the batch size."""
        n = self.batch_size
        t = next((t for t in outs if n and t.dim() and t.shape[0] == n), None)
        if t is None:
            return None
        bad = ~torch.isfinite(t.detach().reshape(n, -1)).all(dim=1)
        return bad.nonzero().flatten().tolist()

    def __enter__(self) -> OpFinder:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def origin(self) -> OpHit | None:
        """The op to blame: the first unintentional non-finite maker, else the NaN maker."""
        return self.first or self.first_nan

    def chain(self) -> list[dict[str, Any]]:
        """Where the first non-finite value came from and where the first NaN was made."""
        out = []
        start = self.first or self.intentional
        if start is not None:
            out.append(start.as_json())
        if self.first_nan is not None and (start is None or start.made != "nan"
                                           or start.op != self.first_nan.op):
            out.append(self.first_nan.as_json())
        return out
