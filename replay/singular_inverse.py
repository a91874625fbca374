"""An op out of its domain on values made from the inverse of a singular matrix.

``torch.linalg.inv`` raises only on a matrix exactly singular in its type; one singular to
rounding (a GP precision ``sum phi^T phi`` of fewer samples than features, without its ridge
``I``) comes back as a finite "inverse" whose entries are rounding noise, not positive
semi-definite: SNGP's predictive variance ``phi^T Sigma phi`` of it is negative and the
mean-field ``sqrt(1 + pi / 8 * var)`` is NaN several ops later. The report said "clamp the
input into the domain", which hides the broken covariance. Only for such an origin, one
forward re-run follows the values made of an ill-conditioned inverse (every op given one
makes one) to the first op that made a non-finite value of one.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode, tree_leaves
from .dispatch import run_op
from .memo import TensorMarks
from .source import user_source

# ops whose result is (a product with) a matrix inverse
_INVERSES = {"linalg_inv_ex", "linalg_inv", "inverse", "cholesky_inverse", "linalg_solve_ex",
             "linalg_solve"}


def _singular(a: torch.Tensor) -> tuple[float, float] | None:
    """(smallest, largest singular value) of matrix ``a`` (the worst of a batch) when its
    condition number is beyond its type's resolution: singular to rounding; else None."""
    if a.dim() < 2 or a.shape[-1] != a.shape[-2] or not a.is_floating_point():
        return None
    s = torch.linalg.svdvals(a.detach().double()).reshape(-1, a.shape[-1])
    lo, hi = s.min(-1).values, s.max(-1).values
    k = int(torch.argmin(lo / hi.clamp_min(1e-300)))
    tol = a.shape[-1] * torch.finfo(a.dtype).eps * float(hi[k])
    return (float(lo[k]), float(hi[k])) if float(lo[k]) <= tol else None


class _Inverted(TorchDispatchMode):
    """Marks each inverse of a singular matrix (``(op, line, singular values)``) and every
    value made of one; ``fed``: the first op given one that made a non-finite value."""

    def __init__(self):
        super().__init__()
        self.marks = TensorMarks()
        self.fed: tuple[str, str | None, tuple] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marks = [m for t in leaves if (m := self.marks.get(t)) is not None]
        out = run_op(func, args, kwargs)
        if self.fed is not None:
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                and t.is_floating_point()]
        with torch.no_grad():
            if name in _INVERSES and args and isinstance(args[0], torch.Tensor) \
                    and bool(torch.isfinite(args[0]).all()) \
                    and (sv := _singular(args[0])) is not None:
                marks = [(f"aten.{name}", user_source(), sv)]
            elif marks and not all(bool(torch.isfinite(t).all()) for t in outs):
                self.fed = (f"aten.{name}", user_source(), marks[0])
                return out
        for t in outs:
            if marks:
                self.marks.put(t, marks[0])
            else:  # (written in place: no longer made of the inverse)
                self.marks.drop(t)
        return out


def singular_inverse_hint(runner, hint: str | None, cause: str, hit) -> str | None:
    """``hint`` for an ``invalid`` origin ``hit`` of finite inputs made of an inverse of a
    singular matrix: which inverse, where, and the ridge that makes it invertible; ``hint``
    as it is otherwise."""
    if cause != "invalid" or hit is None or not hit.inputs_finite or hit.source is None:
        return hint
    watch = _Inverted()
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: watch)
    except Exception:  # (the hint as it is: this only says where its input came from)
        return hint
    if watch.fed is None or watch.fed[:2] != (hit.op, hit.source):
        return hint
    op, line, (lo, hi) = watch.fed[2]
    return (f"{hit.op}'s input was made from {op} ({line}) of a matrix singular to its type "
            f"(singular values {lo:.3g} to {hi:.3g}): that inverse is rounding noise, not "
            "positive semi-definite (a quadratic form phi^T Sigma phi of it negative), and "
            f"clamping {hit.op}'s input would hide it: add a ridge to the matrix's diagonal "
            "before inverting (A + eps * I, eps scaled to A.diagonal().mean(); a GP precision "
            "starts at ridge * I, not 0), or drop the dependent rows (duplicated or constant "
            "rows, a dead feature, fewer samples than features)")
