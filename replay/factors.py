"""Values that are a Cholesky factor's, viewed (its diagonal, a slice of it): where
``linalg.cholesky_ex`` met a pivot <= 0, the matrix was not positive-definite, and the factor
it returns holds that pivot on its diagonal, said only in ``info`` (no error, no host sync). A
``log`` of that diagonal (a Gaussian log-likelihood's ``2 * L.diagonal().log().sum()``) is then
out of its domain because the factorisation failed, which no clamp of the log repairs.

Followed on the autograd graph, as :func:`replay.positive.made_positive` follows exp.
"""

from __future__ import annotations

from .positive import first_inputs

# the factorisations whose factor holds a failed pivot instead of raising
_FACTOR_NODES = {"LinalgCholeskyEx", "LinalgCholesky", "Cholesky"}
# ops that pass a factor's values on unchanged
_VIEW_NODES = {"Diagonal", "Select", "Slice", "View", "UnsafeView", "ReshapeAlias", "Squeeze",
               "Unsqueeze", "Clone", "ToCopy", "Expand", "Permute", "Transpose", "T", "Alias",
               "Narrow", "Index", "Unbind", "AsStrided", "Diag"}


def from_factor(fn, depth: int = 8) -> bool:
    """Whether autograd node ``fn`` passed on (a view of) a Cholesky factor's values."""
    try:
        for op, _ in first_inputs(fn, depth):
            if op in _FACTOR_NODES:
                return True
            if op not in _VIEW_NODES:
                return False
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False
