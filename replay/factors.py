"""Values of a matrix decomposition whose exact-arithmetic properties rounding breaks:

- a Cholesky factor's (viewed: its diagonal, a slice): where ``linalg.cholesky_ex`` met a
  pivot <= 0, the matrix was not positive-definite, and the factor it returns holds that
  pivot on its diagonal, said only in ``info`` (no error, no host sync). A ``log`` of that
  diagonal (a Gaussian log-likelihood's ``2 * L.diagonal().log().sum()``) is then out of its
  domain because the factorisation failed, which no clamp of the log repairs;
- ``eigh``'s eigenvalues: those of a singular positive semi-definite matrix (a covariance of
  fewer samples than features) are 0 in exact arithmetic and come out slightly negative, so
  their ``sqrt``, ``log`` or ``rsqrt`` (a matrix square root, a whitening) is NaN.

Followed on the autograd graph (so only when the forward recorded gradients), as
:func:`replay.positive.made_positive` follows exp.
"""

from __future__ import annotations

from .positive import node_op

# node -> (its output that holds the values, what they are)
_FACTOR_NODES = {"LinalgCholeskyEx": (0, "cholesky"), "LinalgCholesky": (0, "cholesky"),
                 "Cholesky": (0, "cholesky"), "LinalgEigh": (0, "eigenvalues")}
# ops that pass a factor's values on unchanged
_VIEW_NODES = {"Diagonal", "Select", "Slice", "View", "UnsafeView", "ReshapeAlias", "Squeeze",
               "Unsqueeze", "Clone", "ToCopy", "Expand", "Permute", "Transpose", "T", "Alias",
               "Narrow", "Index", "Unbind", "AsStrided", "Diag", "DiagEmbed"}


def made_by(t, depth: int = 8) -> str | None:
    """``"cholesky"`` when tensor ``t`` holds (a view of) a Cholesky factor's values,
    ``"eigenvalues"`` when it holds eigh's eigenvalues, else None."""
    try:
        fn, out = t.grad_fn, t.output_nr
        for _ in range(depth):
            if fn is None:
                return None
            op = node_op(fn)
            if op in _FACTOR_NODES:
                at, kind = _FACTOR_NODES[op]
                return kind if out == at else None
            if op not in _VIEW_NODES:
                return None
            fn, out = next(((f, i) for f, i in fn.next_functions if f is not None),
                           (None, 0))
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None
