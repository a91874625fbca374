"""A root or log of a quadratic form ``x^T M x`` whose matrix, a buffer of the model, is
indefinite.

A neural LinUCB head's exploration bonus ``sqrt(phi^T A^-1 phi)``, a Mahalanobis distance
under a kept precision, a Thompson sampler's posterior variance: the matrix stands for a
positive (semi-)definite one (an inverse design matrix, a precision, a covariance) that the
loop keeps up to date itself, by rank-one updates. When those updates break it (a
Sherman-Morrison downdate of a row never added, or removed twice; a forgetting factor applied
to the inverse; an update with the wrong sign) it gets a negative eigenvalue, and the form
is negative along it in exact arithmetic too: the generic "clamp into the domain" would hide a
wrong matrix. :class:`QuadraticForms` follows which square buffers (2-D, no gradient) each
value was made with, and notes the first root or log of a negative value made with one;
:func:`quadratic_form_hint` names the buffer when it is symmetric and clearly indefinite.
"""

from __future__ import annotations

import weakref

import torch

_ROOTS = {"sqrt", "rsqrt", "log", "log2", "log10"}
_MAX = 4  # square matrices followed per value (a model's first ones)
_NEGATIVE = 1e-3  # an eigenvalue this far below 0, relative to the largest, is no rounding
_SYMMETRIC = 1e-4  # |M - M^T| relative to |M|: a covariance kept by updates, not a weight


class QuadraticForms:
    """The square matrices without gradient each value was made with; ``found``: the first
    root or log of a negative number made with one (those matrices)."""

    def __init__(self):
        # (by identity, held weakly: a view's version counter reads 0 as the op makes it)
        self._of: dict[int, tuple[weakref.ref, tuple[torch.Tensor, ...]]] = {}
        self.found: tuple[torch.Tensor, ...] | None = None

    def track(self, name: str, args, out) -> None:
        if self.found is not None:
            return
        mats: tuple[torch.Tensor, ...] = ()
        for a in args:
            if isinstance(a, torch.Tensor):
                got = self._mats(a) or ((a,) if _square(a) else ())
                mats += tuple(m for m in got if all(m is not k for k in mats))
        if not mats:
            return
        x = args[0]
        if name in _ROOTS and isinstance(x, torch.Tensor) and x.is_floating_point() \
                and bool((x < 0).any()):
            self.found = mats
            return
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._of[id(t)] = (weakref.ref(t), mats[:_MAX])

    def _mats(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else ()


def _square(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[0] == t.shape[1] > 1 and t.is_floating_point() \
        and not t.requires_grad


def _indefinite(m: torch.Tensor) -> tuple[float, float] | None:
    """(smallest, largest magnitude) eigenvalue of symmetric ``m`` in float64, when the
    smallest is clearly below 0; None otherwise (or when ``m`` is no symmetric matrix)."""
    m64 = m.detach().double()
    scale = float(m64.abs().max())
    if scale == 0 or float((m64 - m64.T).abs().max()) > _SYMMETRIC * scale:
        return None
    vals = torch.linalg.eigvalsh(m64)
    top = float(vals.abs().max())
    return (float(vals[0]), top) if float(vals[0]) < -_NEGATIVE * top else None


def _buffer_named(model, m: torch.Tensor) -> str | None:
    """The model's buffer holding ``m``'s values (the re-run may hold a copy of it)."""
    return next((n for n, b in model.named_buffers() if b.shape == m.shape
                 and b.dtype == m.dtype and torch.equal(b, m)), None)


def quadratic_form_hint(hint: str | None, cause: str | None, hit, watch, model
                        ) -> str | None:
    """``hint``, for an invalid root or log of a negative value made with a buffer of the
    model that is a symmetric, indefinite matrix (:class:`QuadraticForms`): that buffer,
    and to fix the updates that broke it rather than clamp."""
    if hint is None or cause != "invalid" or hit is None or watch is None \
            or watch.found is None or hit.op.removeprefix("aten.") not in _ROOTS:
        return hint
    for m in watch.found:
        name = _buffer_named(model, m)
        if name is None or (eig := _indefinite(m)) is None:
            continue
        n = m.shape[0]
        return (f"{hint}; but its input is made with the model's buffer {name!r} ({n} x {n}, "
                f"symmetric), which is indefinite: smallest eigenvalue {eig[0]:.3g} (largest "
                f"magnitude {eig[1]:.3g}, float64), so a quadratic form x^T M x of it is "
                "negative in exact arithmetic too and no clamp or eps makes the value right. "
                "The buffer stands for a positive (semi-)definite matrix (an inverse design "
                "matrix, a precision, a covariance) that the code updating it broke: a "
                "Sherman-Morrison downdate of a row never added or removed twice, a rank-one "
                "update with the wrong sign, a forgetting factor applied to the inverse; fix "
                "that update, or recompute the buffer from its definition (keep a Cholesky "
                "factor and use torch.cholesky_inverse / cholesky_solve) and symmetrise it")
    return hint
