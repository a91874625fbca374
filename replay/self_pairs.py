"""A pole exactly on the diagonal of a square pairwise matrix: each point paired with itself.

A Lennard-Jones energy over ``torch.cdist(pos, pos)`` takes ``sigma / r`` of every distance,
the diagonal's 0 too, then 'masks' the diagonal by a product with ``1 - eye`` (``inf * 0`` is
NaN) or a where (whose backward still sends the gradient through the inf). The cause said
1/0, add an eps or skip the rows: but no row is degenerate, and an eps would keep a huge
self-interaction in every energy. :func:`self_pair_hint` says the zeros are each point's
distance to itself when the op's non-finite values sit exactly on the diagonal of its last
two (square) dims, its input 0 there, and the fix: take only the pairs ``i != j``.

Rounding may leave such a 0 a hair below it: Deep Cauchy Hashing's ``d = bits / 2 * (1 -
cos(u_i, u_j))`` over every pair of the batch is -5e-8 on the diagonal, where a code's cosine
with itself rounds above 1, and ``log(d / gamma)`` is NaN there (``precision``: no wider type
helps a difference of equal terms). The same hint then says so for inputs at or below 0 by no
more than rounding (:data:`ROUNDED`).
"""

from __future__ import annotations

import torch

SELF_PAIRS = ("; but its 0s are exactly the diagonal of a square pairwise matrix, each point "
              "paired with itself (torch.cdist(x, x), x[:, None] - x[None]), no bad record "
              "and no place for an eps: take only the pairs "
              "i < j before the op (r[:, i, j] with i, j = torch.triu_indices(n, n, 1)) or "
              "replace the diagonal first (torch.where(eye, 1, r)); a mask multiplied in "
              "after the op is inf * 0 = NaN")


# what rounding leaves of a self-pair's 0 (a float32 difference of terms of order 1..100)
ROUNDED = 1e-4

ROUNDED_PAIRS = ("; but those inputs, 0 in exact arithmetic and rounded below it, are exactly "
                 "the diagonal of a square pairwise matrix, each point paired with itself (a "
                 "distance, or 1 − cos(u_i, u_j) of a code with itself), no bad record and no "
                 "place for an eps: take only the pairs i != j before the op (r[i, j] with i, "
                 "j = torch.triu_indices(n, n, 1), or torch.where(eye, 1, r)); a mask "
                 "multiplied in after the op is NaN * 0 = NaN")


def on_diagonal(hit, rounded: bool = False) -> bool:
    """Whether ``hit``'s non-finite output is exactly on the diagonal of its last two dims
    (square, n >= 2) and an input it took there is 0 (``rounded``: at most :data:`ROUNDED`
    below 0, or 0)."""
    ev = None if hit is None else hit.evidence
    if ev is None or ev.bad.dim() < 2 or ev.bad.shape[-1] < 2 \
            or ev.bad.shape[-1] != ev.bad.shape[-2] or not bool(ev.bad.any()):
        return False
    eye = torch.eye(ev.bad.shape[-1], dtype=torch.bool, device=ev.bad.device)
    if bool((ev.bad & ~eye).any()):
        return False
    return any(at and x.numel() and bool(((x <= 0) & (x >= -ROUNDED) if rounded else x == 0).all())
               for x, at in zip(ev.inputs, ev.elementwise))


def self_pair_hint(hint: str | None, cause: str | None, hit) -> str | None:
    """``hint`` with :data:`SELF_PAIRS` added for an ``invalid`` op at a self-pair's 0
    (:data:`ROUNDED_PAIRS` for a ``precision`` one at its rounded 0)."""
    if hint is None or cause not in ("invalid", "precision") \
            or not on_diagonal(hit, rounded=cause == "precision"):
        return hint
    return hint + (SELF_PAIRS if cause == "invalid" else ROUNDED_PAIRS)
