"""A matrix product of the weights alone that overflowed: powers of an unstable operator.

A deep Koopman autoencoder's multi-step loss ``matrix_power(K, k)`` over a long horizon, a
linear recurrence's ``A^k``: the product's inputs are square matrices made of the parameters
alone (no sample's data), and a power grows as ``rho^k`` where the matrix's spectral radius
``rho`` is above 1 (K initialised with a gain of 1.5 overflows float32 at k = 219). Rescaling
the inputs or float64 only moves the horizon where it overflows; the fix is a stable operator. Its continuous-time kin, the
``matrix_exp(L dt)`` of a generator: its entries grow as ``e^(dt max Re lambda(L))``, which no
row max subtracted before an exp bounds.
"""

from __future__ import annotations

import torch

# matrix products (matrix_power and ``@`` of square matrices dispatch to these)
_PRODUCTS = {"mm", "bmm", "matmul", "linalg_matrix_power", "matrix_power"}
_EXPS = {"linalg_matrix_exp", "matrix_exp"}

ADVICE = ("its inputs are square matrices made of the weights alone, with spectral radius up "
          "to {rho} (above 1): a power of a linear operator (matrix_power(K, k), a recurrence "
          "A^k) grows as rho^k, so rescaling or float64 only moves the horizon where it "
          "overflows; keep the operator's spectral radius at most 1 (initialise it with a "
          "gain at most 1, divide it by its spectral norm, a spectral-radius penalty, an "
          "orthogonal or Cayley parametrisation) or shorten the horizon")
EXP_ADVICE = ("the matrix it exponentiated has eigenvalues of real part up to {top} and "
              "matrix_exp grows as e^(max Re lambda): bound the generator (a stable "
              "parametrisation: S - S^T - D D^T, skew-symmetric plus negative semi-definite, "
              "has Re lambda <= 0) or the time step it is scaled by, or compute it in float64")


# the largest matrix whose eigenvalues the evidence computes (a small operator, not a layer)
_LARGEST = 256


def radii(op: str, ins: list[torch.Tensor]) -> list[float | None]:
    """For a matrix product ``op`` whose every input is square, each input's largest spectral
    radius (float64, over a batch of matrices); for a matrix exponential, its input's largest
    eigenvalue real part; else []. Kept in the op's evidence, whose inputs are taken at the
    non-finite positions only."""
    name = op.removeprefix("aten.")
    if name not in _PRODUCTS | _EXPS or not ins or any(
            t.dim() < 2 or t.shape[-1] != t.shape[-2] or not 0 < t.shape[-1] <= _LARGEST
            for t in ins):
        return []
    with torch.no_grad():
        vals = [torch.linalg.eigvals(t.detach().double()) if bool(torch.isfinite(t).all())
                else None for t in ins]
    return [None if v is None else float(v.real.max() if name in _EXPS else v.abs().max())
            for v in vals]


def operator_power_advice(op: str | None, ev) -> str | None:
    """The advice for a matrix product that overflowed on inputs made of the weights alone,
    one of them square with spectral radius above 1, or a matrix exponential's; else None."""
    if op is not None and op.removeprefix("aten.") in _EXPS and ev is not None \
            and ev.radii and ev.radii[0] is not None:
        return EXP_ADVICE.format(top=f"{ev.radii[0]:.3g}")
    if op is None or op.removeprefix("aten.") not in _PRODUCTS or ev is None \
            or not ev.of_weights:
        return None
    known = [r for r in ev.radii if r is not None]
    if not known or max(known) <= 1:
        return None
    return ADVICE.format(rho=f"{max(known):.3g}")
