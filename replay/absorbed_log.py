"""A 0 made by ``log(1 + x)`` where the type absorbed ``x``, found at the op that took it.

``1 + x`` is exactly 1 where ``x`` is below the type's resolution at 1 (6e-8 in float32),
and its log is exactly 0 where float64's is ``x``. The Transformer Hawkes Process's own
softplus, ``1 / beta * log(1 + exp(beta * x))``, copied by many point-process repositories,
makes an intensity of exactly 0 so wherever ``beta * x`` is below about -17; the
log-likelihood's ``log`` of that intensity is -inf several ops later (a product with the type
mask, its sum), where the float64 re-run says ``precision`` but the line to fix is the
softplus's (``torch.log1p``, ``F.softplus``), not the log the report names. Only on that
path: one forward re-run follows the 0s such a log makes through the ops that keep a 0 a 0,
to the first op that made a non-finite value of one.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode, tree_leaves
from .dispatch import run_op
from .memo import TensorMarks
from .source import user_source

_LOGS = {"log", "log2", "log10"}


class _Absorbed(TorchDispatchMode):
    """Marks ``1 + x`` rounded to 1 (``sums``), the 0s a log made of it and every value an
    op kept such a 0 in (``zeros``: (line, largest x)); ``fed``: the first op given one that
    made a non-finite value, with its line and that mark."""

    def __init__(self):
        super().__init__()
        self.sums, self.zeros = TensorMarks(), TensorMarks()
        self.fed: tuple[str, str | None, tuple] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marks = [m for t in leaves if (m := self.zeros.get(t)) is not None]
        made = self.sums.get(args[0]) if name in _LOGS and args else None
        out = run_op(func, args, kwargs)
        if self.fed is not None or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point():
            return out
        with torch.no_grad():
            if name == "add":
                self._one_plus(args, kwargs, out)
            elif made is not None and bool((out == 0).any()):
                self.zeros.put(out, (user_source(), made))
            elif marks and not bool(torch.isfinite(out).all()):
                self.fed = (f"aten.{name}", user_source(), marks[0])
            elif marks and bool((out == 0).any()):
                self.zeros.put(out, marks[0])
            else:  # (written in place where it held one: no 0 of that log's left)
                self.zeros.drop(out)
        return out

    def _one_plus(self, args, kwargs, out: torch.Tensor) -> None:
        """``x + 1`` (Python's ``1 + x``) that is exactly 1 where ``x`` is not 0."""
        if len(args) != 2 or kwargs.get("alpha", 1) != 1 or not isinstance(args[1], (int, float)) \
                or args[1] != 1 or not isinstance(args[0], torch.Tensor) \
                or args[0].shape != out.shape:
            return
        lost = (out == 1) & (args[0] != 0)
        if bool(lost.any()):
            self.sums.put(out, float(args[0][lost].abs().max()))


def absorbed_hint(runner, hint: str | None, cause: str, hit) -> str | None:
    """``hint`` for a ``precision`` origin ``hit`` that took a 0 such a log made: where the
    0 was made and the formula that keeps ``x``; ``hint`` as it is otherwise."""
    if cause != "precision" or hit is None or not hit.inputs_finite or hit.source is None:
        return hint
    watch = _Absorbed()
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: watch)
    except Exception:  # (the hint as it is: this only says where its 0 came from)
        return hint
    if watch.fed is None or watch.fed[:2] != (hit.op, hit.source):
        return hint
    line, x = watch.fed[2]
    dt = hit.evidence.dtype if hit.evidence is not None else torch.float32
    half_ulp = torch.finfo(dt).eps / 2
    return (f"{hit.op} of 0, where float64 has a positive value: that 0 was made at {line} "
            f"by log(1 + x) of an x (as large as {x:.3g}) below half of "
            f"{str(dt).removeprefix('torch.')}'s resolution at 1 ({half_ulp:.3g}), where 1 + x "
            "rounds to exactly 1 and its log to 0 (float64's is about x); the ops after it "
            f"kept the 0 (a product, a masked sum) until {hit.op} took it: write "
            "torch.log1p(x) there (for log(1 + exp(t)): F.softplus(t), F.softplus(t, beta) "
            "for a softplus with a beta, or torch.logaddexp(0, t)), not an eps after it, "
            "which puts the eps where x belongs")
