"""Running aten ops inside a dispatch mode, and the float64 re-run's two modes: every op in
float64 (:class:`Float64`), one call's values kept (:class:`OpAt`, the float64 view of the op
:class:`replay.ops.OpFinder` blamed)."""

from __future__ import annotations

import torch

from recorder.finite import real_view

from .compat import TorchDispatchMode, tree_leaves, tree_map, writes_arguments
from .float32_kernels import float32_only, run_in_float32
from .float64 import DRAWS, as_float64, draw_as_recorded, upcast
from .source import OP_ERROR


def run_op(func, args, kwargs):
    """``func(*args, **kwargs)`` inside a dispatch mode. What it raises is the model's op failing
    (``multinomial`` on NaN probabilities), marked so a re-run does not take it for the
    replay's own error (see ``source.raised_by_model``)."""
    try:
        return func(*args, **kwargs)
    except Exception as e:
        setattr(e, OP_ERROR, True)
        raise


def clone_args(args, kwargs):
    def clone(v):
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    return tree_map(clone, (args, kwargs))


def float_leaves(tree) -> list[torch.Tensor]:
    """The floating and complex tensors of ``tree``, complex ones as their real views
    (``recorder.finite.real_view``), so the op finder's ends, masks and evidence see a complex
    op's NaN (RotatE's ``r / r.abs()`` of a zero relation) where it is made, not at the first
    real op after it."""
    return [real_view(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex()) and t.numel() and not t.is_meta]


def overwritten_out(args, kwargs) -> list[torch.Tensor]:
    """:func:`float_leaves` of an op's arguments less its ``out=`` destination, whose old
    values it overwrites and never reads (``torch.mm(a, b, out=buf[:n])`` into a reused,
    uninitialised buffer: a chunked log-softmax's tiles), so no input of the op; one also
    given as an argument (``torch.add(a, b, out=a)``) stays one."""
    if not kwargs or "out" not in kwargs:
        return float_leaves((args, kwargs))
    return float_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))


class OpAt(TorchDispatchMode):
    """Keeps the inputs and outputs of the ``occurrence``-th call of ``op`` (``"aten.log"``)
    made inside it: the float64 re-run's view of the op that :class:`OpFinder` blamed."""

    def __init__(self, op: str, occurrence: int):
        super().__init__()
        self.name = op.partition(".")[2] or op  # (a custom op's own namespace too)
        self.occurrence = occurrence
        self.seen = 0
        self.inputs: list[torch.Tensor] | None = None
        self.outputs: list[torch.Tensor] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func.overloadpacket.__name__ == self.name and self.inputs is None
        if hit:
            hit = self.seen == self.occurrence
            self.seen += 1
        given = clone_args(args, kwargs) if hit and writes_arguments(func) else (args, kwargs)
        out = run_op(func, args, kwargs)
        if hit:
            self.inputs = [t.detach() for t in float_leaves(given)]
            self.outputs = [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                            and t.is_floating_point() and t.numel()]
        return out


class Float64(TorchDispatchMode):
    """Every aten op computes in float64: floating (and complex) inputs are widened, ``dtype=``
    arguments (``x.half()``, ``x.float()``, ``sum(dtype=...)``) become float64, and factory ops
    use float64 as the default dtype. Model code that casts on its own (a layer run with
    ``.half()``) then still runs in float64 instead of mixing dtypes and failing. Random ops
    draw in ``draw``, the step's own type, then widen (see ``draw_as_recorded``)."""

    def __init__(self, draw: torch.dtype | None = None):
        super().__init__()
        self.draw = draw

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
        if self.draw is not None and func.overloadpacket.__name__ in DRAWS:
            return draw_as_recorded(func, args, kwargs, self.draw, writes_arguments(func))
        if float32_only(func):  # fake quantization: float32 kernels only
            return run_in_float32(func, args, kwargs, run_op)
        args, kwargs = as_float64(func, args, kwargs)
        if not writes_arguments(func):
            args, kwargs = upcast(args), upcast(kwargs)
        return run_op(func, args, kwargs)
