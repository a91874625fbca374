"""A division by singular values of 0: a pseudo-inverse of a rank-deficient matrix.

Exact DMD's ``U_r^* Y V_r S_r^-1``, a whitening ``U S^-1``, a hand-written ``pinv`` as
``V diag(1 / S) U^T``: the truncation rank is a constant of the code, and a matrix of lower
rank (snapshots all the same: a trajectory at its fixed point, duplicated or zero-padded
frames, a constant record) has singular values of exactly 0 inside it, so ``/ S`` is x/0 or
0/0 there. An eps on the divisor keeps the rounding noise of those directions and scales it
by 1 / eps; the fix is what ``torch.linalg.pinv`` does, a truncation by a tolerance.
"""

from __future__ import annotations

ADVICE = ("truncate by a tolerance, as torch.linalg.pinv and lstsq do: keep the singular "
          "values above rtol * S.max(-1) (rtol about max(m, n) * eps of the type) and zero the "
          "reciprocal of the rest (torch.where(S > tol, 1 / S, 0), with a safe S in the "
          "division for the gradient), or call torch.linalg.pinv; a record whose snapshots "
          "are all the same (a trajectory at its fixed point, duplicated or zero-padded "
          "frames) has rank 0 or 1, below any fixed truncation rank")


def singular_divisor(op: str, smallest: str) -> tuple[str, str]:
    """What a division by singular values (the ``smallest`` of them 0) was given, and the
    advice's key."""
    return (f"{op} by a singular value of {smallest} from linalg.svd: the "
            "matrix is rank-deficient, and a pseudo-inverse's 1 / S is infinite in the "
            "directions it lacks", "singular_values")
