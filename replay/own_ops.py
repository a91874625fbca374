"""A user's own op (``torch.library.custom_op``: a fused kernel with a Python implementation)
that made a non-finite value of finite inputs. The dispatch mode sees it as one op, its
insides running below the mode; its Python kernel is re-run here on copies of the op's inputs
under a fresh op finder, which names the aten op and the line inside it that made the value
and that op's evidence (``x / x.norm()`` of a zero row: 0/0), for the cause and a note.

What an op made includes what it wrote beside its results (:func:`made_by`): a custom op's
``out``, and a built-in one's running statistics (``native_batch_norm`` writes ``running_var``
without its schema saying so: the overflow an outlier record makes there is the origin)."""

from __future__ import annotations

import linecache
from typing import Any

import torch

from .compat import (
    custom_op_kernel,
    returns_values,
    tree_leaves,
    writes_arguments,
    written_places,
)
from .dispatch import clone_args, float_leaves, overwritten_out
from .hits import OpHit

_BUILT_IN = ("aten", "prims", "quantized", "_quantized", "quantized_decomposed", "c10d",
             "_c10d_functional", "_dtensor")


def op_name(func) -> str:
    """``aten.div``, or a custom op's own namespace: ``mylib.fused_norm``."""
    space = getattr(func, "namespace", "aten") or "aten"
    return f"{space}.{func.overloadpacket.__name__}"


def written(func, args, kwargs) -> list[torch.Tensor]:
    """The arguments custom op ``func`` returning nothing writes (``mutates_args=("out",)``),
    by its schema; none for a built-in op (their in-place and ``out=`` forms are the
    finder's own) or one that returns a value."""
    if getattr(func, "namespace", "aten") in _BUILT_IN:
        return []
    # (one returning what it wrote is in place: it reads that too)
    places = [] if returns_values(func) else written_places(func)
    return float_leaves([args[i] if i < len(args) else (kwargs or {}).get(name)
                         for i, name in places])


def inputs_of(func, args, kwargs) -> list[torch.Tensor]:
    """The op's inputs (``dispatch.overwritten_out``), less the buffers a custom op returning
    nothing writes its results into: ``torch.empty_like`` ones, whose old values it never
    needs to read (a fused kernel's ``out``)."""
    ins = overwritten_out(args, kwargs)
    dest = {id(t) for t in written(func, args, kwargs)}
    return [t for t in ins if id(t) not in dest] if dest else ins


def made_by(func, args, kwargs, out, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The op's results: ``outs``, then the arguments it wrote beside them (batch norm's
    running statistics: a record of 1e20 overflows ``running_var`` while the output stays
    finite); or where a custom op returns nothing, what it wrote."""
    if not outs and out is None:
        return written(func, args, kwargs)
    places = _UNDECLARED.get(func.overloadpacket.__name__) or (
        written_places(func) if outs and writes_arguments(func) else None)
    if outs and places:
        got = {id(t) for t in outs}
        return outs + [t for t in float_leaves([args[i] if i < len(args) else kwargs.get(name)
                                                for i, name in places]) if id(t) not in got]
    return outs


def writes_into(func) -> bool:
    """``func`` writes into an argument: in place, ``out=``, or running statistics its schema
    does not declare (native_batch_norm's)."""
    return writes_arguments(func) or func.overloadpacket.__name__ in _UNDECLARED


# ops writing their running statistics that their schemas do not declare as written
_UNDECLARED = {name: ((3, "running_mean"), (4, "running_var")) for name in (
    "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")}


def inner_hit(func, args, kwargs, finder) -> OpHit | None:
    """The op inside custom op ``func``'s Python kernel that made its first non-finite value,
    re-run on copies of ``(args, kwargs)`` under a fresh op finder like ``finder``; None for a
    built-in op, one without a Python kernel, or one whose re-run made none (or raised)."""
    if getattr(func, "namespace", "aten") in _BUILT_IN:
        return None
    device = next((t.device.type for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)), "cpu")
    kernel = custom_op_kernel(func, device)
    if kernel is None:
        return None
    given_args, given_kwargs = clone_args(args, kwargs)
    watch = type(finder)(finder.samples)  # (an OpFinder: ops imports this module)
    try:
        with torch.no_grad(), watch:
            kernel(*given_args, **given_kwargs)
    except Exception:  # (the op is named without its insides)
        return None
    return watch.origin()


def adopt(hit: OpHit, inner: OpHit | None) -> OpHit:
    """``hit`` (the custom op) with the inner op's evidence (what its cause reads: the inner
    op's inputs) and rows where it has none; the inner op kept for the note."""
    if inner is None:
        return hit
    hit.inner = inner
    hit.evidence = inner.evidence if inner.evidence is not None else hit.evidence
    hit.rows = hit.rows or inner.rows
    return hit


def note_inner(report: dict[str, Any], hit: OpHit | None) -> None:
    """Add the note naming the aten op and line inside a custom op that made the value."""
    inner = getattr(hit, "inner", None)
    if inner is None or not inner.source:
        return
    path, _, line = inner.source.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    report["problems"].append(f"{hit.op} is a custom op: its own code made the {inner.made}, {inner.op} at "
            f"{inner.source}" + (f" ({text})" if text else "")
            + "; fix that formula at this input (an eps, or skip the rows where it is at "
            "its pole)")
