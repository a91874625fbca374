"""A linear solve that made NaN or Inf of finite inputs: a singular system, not a pole.

``torch.linalg.lu_factor_ex`` and ``solve_ex`` report a zero pivot in ``info`` and raise
nothing, and ``lu_solve`` then divides by it. The generic text of an op that left its domain
("clamp the op's input away from the pole") has no input to clamp here: the matrix has no
full rank, so the records that built it are degenerate (a weighted DLT's matches all at one
point, collinear corners), or the library that solved it meant to find out: kornia's
``safe_solve_with_mask`` solves every system once, detached, and keeps those whose solution
is finite; a sample it finds singular is marked invalid (its homography NaN on purpose).
"""

from __future__ import annotations

__all__ = ["SOLVES", "singular_solve"]

# solves that return at a singular matrix instead of raising
SOLVES = frozenset({"linalg_lu_solve", "lu_solve", "linalg_solve_ex", "_linalg_solve_ex",
                    "triangular_solve", "linalg_solve_triangular", "cholesky_solve"})


def singular_solve(op: str) -> str:
    """What a solve's non-finite result of finite inputs says (the advice follows it)."""
    return (f"{op} of a singular system (a zero pivot in its factor, which lu_factor_ex and "
            "solve_ex report in info without raising), the matrix of the rows named of no full "
            "rank: a homography or pose from repeated or collinear points, a design matrix with "
            "a zero or repeated column (where a library solves only to test the result and "
            "marks the sample invalid, as kornia's safe_solve_with_mask does, the NaN that "
            "reached the loss is its mark for that sample: drop or repair such records where "
            "the data is made, or skip the samples it marks)")
