"""Values of a matrix decomposition whose exact-arithmetic properties rounding breaks:

- a Cholesky factor's (viewed: its diagonal, a slice): where ``linalg.cholesky_ex`` met a
  pivot <= 0, the matrix was not positive-definite, and the factor it returns holds that
  pivot on its diagonal, said only in ``info`` (no error, no host sync). A ``log`` of that
  diagonal (a Gaussian log-likelihood's ``2 * L.diagonal().log().sum()``) is then out of its
  domain because the factorisation failed, which no clamp of the log repairs;
- ``eigh``'s eigenvalues: those of a singular positive semi-definite matrix (a covariance of
  fewer samples than features) are 0 in exact arithmetic and come out slightly negative, so
  their ``sqrt``, ``log`` or ``rsqrt`` (a matrix square root, a whitening) is NaN;
- ``svd``'s singular values: 0 where the matrix is rank-deficient, a pseudo-inverse's divisor
  (:mod:`replay.singular_values`);
- the diagonal of a factor the code built itself with ``diag_embed`` (a learned mass matrix
  ``M = L L^T`` whose raw diagonal no softplus keeps positive): a log-determinant's
  ``2 * log(L.diagonal()).sum()`` of a pivot <= 0 the parametrisation allowed, which positivity
  by construction fixes, not a clamp of the log.

Followed on the autograd graph (so only when the forward recorded gradients), as
:func:`replay.positive.made_positive` follows exp.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

# node -> (its output that holds the values, what they are)
_FACTOR_NODES = {"LinalgCholeskyEx": (0, "cholesky"), "LinalgCholesky": (0, "cholesky"),
                 "Cholesky": (0, "cholesky"), "LinalgEigh": (0, "eigenvalues"),
                 "LinalgSvd": (1, "singular_values"), "LinalgSvdvals": (0, "singular_values")}
# ops that pass a factor's values on unchanged
_VIEW_NODES = {"Diagonal", "Select", "Slice", "View", "UnsafeView", "ReshapeAlias", "Squeeze",
               "Unsqueeze", "Clone", "ToCopy", "Expand", "Permute", "Transpose", "T", "Alias",
               "Narrow", "Index", "Unbind", "AsStrided", "Diag", "DiagEmbed"}
# the advice for a log of such a factor's diagonal entry <= 0 (replay.cause_text)
BUILT_FACTOR = ("keep the diagonal positive by construction: softplus (or exp) of the raw "
                "diagonal plus a small eps, diag_embed(F.softplus(raw) + 1e-4), as a "
                "positive-definite parametrisation does; a clamp before the log leaves the "
                "matrix singular where the raw entry is <= 0")
# ops that keep a matrix's diagonal as it was, after the diagonal was taken (a factor's
# strictly lower part written in: tril, index_put at tril_indices(d, d, -1))
_KEEP_DIAGONAL = {"Tril", "IndexPut"}


def made_by(t, depth: int = 8) -> str | None:
    """``"cholesky"`` when tensor ``t`` holds (a view of) a Cholesky factor's values,
    ``"eigenvalues"`` when it holds eigh's eigenvalues, ``"singular_values"`` svd's S,
    ``"built_factor"`` the diagonal of a triangular factor the code built itself from a raw
    diagonal (``diag_embed``: a learned mass or covariance matrix's Cholesky parametrisation,
    no decomposition behind it), else None."""
    built = diagonal = False
    try:
        fn, out = t.grad_fn, t.output_nr
        for _ in range(depth):
            if fn is None:
                break
            op = node_op(fn)
            if op in _FACTOR_NODES:
                at, kind = _FACTOR_NODES[op]
                return kind if out == at else None
            if op not in _VIEW_NODES and not (diagonal and op in _KEEP_DIAGONAL):
                break
            built = built or (diagonal and op in ("DiagEmbed", "Diag"))
            diagonal = diagonal or op == "Diagonal"
            fn, out = next(((f, i) for f, i in fn.next_functions if f is not None),
                           (None, 0))
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return "built_factor" if built else None


# decomposition nodes -> (saved values, how to read them) whose derivative's pole is a tie:
# eigh/svd divide by differences between values, qr by R's diagonal
_TIES = {"LinalgEigh": ("eigenvalues", "gap"), "LinalgSvd": ("S", "gap"),
         "LinalgQr": ("R", "diagonal")}
TIE = 16  # a tie: within this many units of rounding (of the largest value) per value


def at_tie(node) -> bool | None:
    """For a node of an eigen, singular value or QR decomposition (else None): whether its
    saved values are at its derivative's pole to their type's precision, two values (or an
    R diagonal entry and 0) apart by no more than :data:`TIE` * n units of rounding of the
    largest. Exact ties (a zero column) and ties that rounding left a hair apart alike: there
    the gradient is infinite, or the reciprocal of rounding noise."""
    op = node_op(node)
    if op not in _TIES:
        return None
    name, how = _TIES[op]
    try:
        v = saved_value(node, name)
    except Exception:  # (a node that saved something else)
        v = None
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.numel() < 2:
        return False
    v = v.detach().diagonal(dim1=-2, dim2=-1).abs() if how == "diagonal" else v.detach()
    top = float(v.abs().max())
    near = v.min(-1).values if how == "diagonal" else v.sort(-1).values.diff(dim=-1).min(-1).values
    return bool((near <= TIE * v.shape[-1] * torch.finfo(v.dtype).eps * top).any()) and top > 0
