"""A log-determinant of a field of small matrices that is negative somewhere: a map folding.

A deformation's Jacobian ``I + grad u``, one 2x2 or 3x3 matrix per pixel or voxel (a
registration field's log-Jacobian prior, a mesh's per-element map), has a negative determinant
where the map folds over itself (reverses orientation), not where rounding made it so. The
log-determinant advice (``slogdet(W).logabsdet``, right for Glow's 1x1 convolution, whose
sign is arbitrary) would count a fold as an ordinary volume change and leave it unpunished.
:func:`folds` tells such a field by its shape; :data:`ADVICE` is what the hint says instead.
"""

from __future__ import annotations

import torch

ADVICE = ("the sign is the map's orientation: do not take logabsdet, which counts a fold as a "
          "volume change; take the log where det > 0 only and penalise the folds (relu(-det), "
          "a negative-Jacobian penalty), and keep the map from folding (a smaller step, a "
          "stronger smoothness term, or a diffeomorphic map: a velocity field integrated by "
          "scaling and squaring)")


def folds(x: torch.Tensor) -> bool:
    """``x`` is a field of 2x2 or 3x3 matrices: a batch with at least one position dim."""
    return x.dim() >= 4 and x.shape[-1] == x.shape[-2] and x.shape[-1] in (2, 3)


def fold_exit(op: str, det: str) -> tuple[str, str]:
    """What a log-determinant of such a field was given, and the advice's key."""
    return (f"{op} of a field of Jacobians (a 2x2 or 3x3 matrix per position) with a negative "
            f"determinant ({det}): the map folds there (orientation reversed)", "fold")
