"""Whether a value is a product (or a sum of products: a dot, a matrix product's entry) of
two operands equal where it is taken: a value compared with itself (a vector's dot with
itself, a cosine of a record with itself), which exact arithmetic makes exactly what the
comparison of equal things is (a unit vector's cosine with itself: 1).

The value's autograd graph is walked back from its node, through the ops that pass a value
on unchanged in exactness (clamps, copies, views, transposes, a quotient's numerator), and
through a sum, to the product whose two saved operands are compared at the entries asked
for (``replay.exact_edge``). Anything else on the way: unknown (None).
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

__all__ = ["equal_at"]

# nodes whose output, entry by entry, is their first input's (or a monotone function of it,
# whose edge is its input's edge: a clamp into the domain; a quotient by a norm: its numerator)
_PASS = {"Clamp", "ClampMin", "ClampMax", "Clone", "ToCopy", "Alias", "Div"}
_RESHAPES = {"View", "UnsafeView", "Reshape", "Squeeze", "Expand"}


def equal_at(node, at: torch.Tensor, depth: int = 16) -> bool | None:
    """Whether the output of autograd node ``node``, at the entries ``at`` (a boolean mask
    of its shape), is a product or a sum of products of operands equal there; None when
    the graph does not say (another op, an operand not saved)."""
    for _ in range(depth):
        if node is None:
            return None
        kind = node_op(node)
        if kind in ("Mul", "Mm", "Addmm", "Bmm"):
            return _product(node, kind, at)
        if kind in _PASS:
            pass
        elif kind in _RESHAPES or kind.startswith("Sum"):
            at = _back(node, kind, at)
        elif kind in ("T", "Transpose"):
            at = at.t() if kind == "T" else at.transpose(_dim(node, "dim0", at.dim()),
                                                         _dim(node, "dim1", at.dim()))
        elif kind == "Unsqueeze":
            at = at.squeeze(_dim(node, "dim", at.dim()))
        else:
            return None
        if at is None:
            return None
        node = node.next_functions[0][0] if node.next_functions else None
    return None


def _dim(node, name: str, ndim: int) -> int:
    return _dim_of(saved_value(node, name), ndim)


def _back(node, kind: str, at: torch.Tensor) -> torch.Tensor | None:
    """``at`` as a mask of the node's input: a reshape's sizes, a sum's reduced entries."""
    sizes = saved_value(node, "self_sym_sizes")
    if sizes is None:
        return None
    sizes = tuple(int(s) for s in sizes)
    if kind != "Sum" and not kind.startswith("Sum"):
        return at.reshape(sizes) if at.numel() == torch.Size(sizes).numel() else None
    dims = saved_value(node, "dim")  # (SumBackward0: every dim, to a 0-d value)
    if dims is not None and not saved_value(node, "keepdim"):
        for d in sorted(_dim_of(d, len(sizes)) for d in dims):
            at = at.unsqueeze(d)
    return at.reshape([1] * len(sizes)).expand(sizes) if dims is None else at.expand(sizes)


def _dim_of(d: int, ndim: int) -> int:
    return (d - 2 ** 64 if d >= 2 ** 63 else d) % max(ndim, 1)  # (a negative dim, unsigned)


def _product(node, kind: str, at: torch.Tensor) -> bool | None:
    """Whether the product's two saved operands are equal at the entries ``at`` of its
    output (of a matrix product: row i of the first, column j of the second)."""
    a, b = (saved_value(node, n) for n in (("mat1", "mat2") if kind == "Addmm" else
                                            ("self", "mat2") if kind in ("Mm", "Bmm") else
                                            ("self", "other")))
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if kind == "Mul":
        try:
            a, b = torch.broadcast_tensors(a, b)
            return bool((a[at.expand(a.shape)] == b[at.expand(b.shape)]).all())
        except RuntimeError:  # (a mask of another shape: the walk lost the entries)
            return None
    if at.shape != (*a.shape[:-1], b.shape[-1]):
        return None
    return all(torch.equal(a[tuple(e[:-1])], b[(*e[:-2], slice(None), e[-1])])
               for e in at.nonzero().tolist())
