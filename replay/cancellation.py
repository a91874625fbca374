"""Differences of nearly equal terms that rounding left just below 0.

A variance written as ``E[x²] − E[x]²`` (MeshGraphNets' and GNS's online normaliser, a
hand-written batch norm) or a squared distance as ``|a|² + |b|² − 2a·b`` is at least 0 in
exact arithmetic, but the two terms agree in every digit the type holds when the spread is
0 (a feature constant over the data, two coincident points), and the difference is then a
few units in their last place either side of 0: sqrt or log of it is NaN. When that rounding
came in with the terms — running sums a normaliser accumulated in float32 over earlier steps,
kept in buffers — the float64 re-run of the step computes the same negative difference from
the same terms, and reads as "invalid, exact arithmetic makes it too". Their sizes tell
instead: a value below 0 by a few dozen of the terms' units in the last place at most is
rounding (``precision``), not a value truly outside the domain.
"""

from __future__ import annotations

import torch

from .memo import TensorMemo
from .op_inputs import values_at
from .trig_root import TrigRoots
from .unit_complement import UnitSquares

ULPS = 64  # below 0 by at most this many of its terms' units in the last place: rounding
# ops whose domain ends at 0 from below (pow: a fractional exponent of a negative base)
_EDGE_AT_ZERO = {"sqrt", "rsqrt", "log", "log2", "log10", "pow"}
_SUMS = {"add", "sub", "rsub"}


class Cancellation:
    """The magnitude of the terms (per element) of the sums and differences that the watched
    code made slightly negative by cancellation, kept while the result lives unmodified; a
    product or quotient of one keeps it, scaled (``(s2 - s * s / n) / (n - 1)``)."""

    def __init__(self):
        self._terms = TensorMemo()
        self.unit_squares = UnitSquares()  # 1 - x², below 0 where x rounds past ±1
        self.trig = TrigRoots()  # cos(x), below 0 where x rounds past pi/2 (lat at a pole)

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
              leaves: list) -> None:
        """After an op with finite inputs ran: keep its terms' size when it cancelled below 0."""
        self.unit_squares.track(name, ins, outs, leaves)
        self.trig.track(name, ins, outs)
        if len(outs) != 1 or not outs[0].is_floating_point() or outs[0].is_complex() \
                or not ins or name not in _SUMS | {"mul", "div"} \
                or any(t.is_nested or t.layout != torch.strided for t in (*ins, outs[0])):
            return  # (nested and sparse tensors: the fast path of nn.TransformerEncoder)
        out = outs[0].detach()
        with torch.no_grad():
            terms = self._sum_terms(ins, leaves) if name in _SUMS else \
                self._scaled(name, ins, leaves)
            if terms is None:
                return
            try:
                terms = torch.broadcast_to(terms, out.shape)
            except RuntimeError:
                return
            tol = ULPS * torch.finfo(out.dtype).eps
            # (finite terms only: a quotient by 0 is no rounding)
            if bool(((out < 0) & (-out <= tol * terms) & torch.isfinite(terms)).any()) or (
                    name in _SUMS and self._chained(name, ins)
                    and bool((out.abs() < terms).any())):
                self._terms.put(outs[0], terms)

    def _chained(self, name: str, ins: list[torch.Tensor]) -> bool:
        """A difference of values >= 0 (squares: ``E ** 2 - px ** 2``), or a sum taking one
        whose terms are kept: the first step of a chain whose later step cancels below 0
        (``E ** 2 - px ** 2 - py ** 2 - pz ** 2``, a massless four-vector's m²), whose
        rounding is of the chain's largest term, not of its last step's."""
        if any(self._terms.get(t) is not None for t in ins):
            return True
        return name in ("sub", "rsub") and len(ins) == 2 and all(
            t.is_floating_point() and bool((t >= 0).all()) for t in ins)

    def _sum_terms(self, ins: list[torch.Tensor], leaves: list) -> torch.Tensor | None:
        sizes = [self._size(t) for t in ins]
        numbers = [abs(float(v)) for v in leaves[1:] if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        top = sizes[0]
        for s in sizes[1:]:
            top = torch.maximum(top, s)
        return top.clamp_min(max(numbers, default=0.0)) if numbers else top

    def _scaled(self, name: str, ins: list[torch.Tensor], leaves: list) -> torch.Tensor | None:
        """A product or quotient whose first factor has kept terms: the terms scaled alike."""
        terms = self._terms.get(ins[0])
        if terms is None:
            return None
        other = ins[1].detach().abs() if len(ins) > 1 else next(
            (abs(float(v)) for v in leaves[1:] if isinstance(v, (int, float))
             and not isinstance(v, bool)), None)
        if other is None:
            return None
        return terms * other if name == "mul" else terms / other

    def _size(self, t: torch.Tensor) -> torch.Tensor:
        kept = self._terms.get(t)
        return kept if kept is not None else t.detach().abs()

    def at(self, t: torch.Tensor, bad: torch.Tensor) -> torch.Tensor | None:
        """The kept terms' size at the op's non-finite positions ``bad`` (float64), or None."""
        kept = self._terms.get(t)
        return None if kept is None else values_at(kept, bad)[0]


def cancelled(name: str, inputs: list[torch.Tensor], terms: list,
              dtypes: list[torch.dtype]) -> tuple[float, float] | None:
    """(the most negative value, its terms' size) when op ``name``'s first input (``inputs``:
    its values where the op went non-finite, of type ``dtypes[0]``) is below 0 only by
    rounding of its terms."""
    if name.rstrip("_") not in _EDGE_AT_ZERO or not inputs or not terms or terms[0] is None:
        return None
    x, size = inputs[0], terms[0]
    neg = x < 0
    if x.shape != size.shape or not bool(neg.any()):
        return None
    near = -x[neg] <= ULPS * torch.finfo(dtypes[0]).eps * size[neg]
    if not bool((near & torch.isfinite(size[neg])).all()):
        return None
    i = int(torch.argmin(x))
    return float(x[i]), float(size[i])


def rounded_hint(name: str, what: str, ev, capture=None) -> str | None:
    """:func:`hint` when op ``name``'s input (its :class:`~replay.hits.Evidence` ``ev``) is
    such a cancelled difference (:func:`cancelled`), else None. ``capture``: the float64
    re-run's view of the op (:class:`~replay.dispatch.OpAt`), which tells where the rounding
    came from."""
    found = cancelled(name, ev.inputs, ev.terms, ev.input_dtypes)
    if found is None:
        return None
    return hint(what, found, ev.input_dtypes[0], wide_value(capture, ev, found[0]))


def wide_value(capture, ev, low: float) -> float | None:
    """The float64 re-run's value of the op's first input where the op's own is lowest
    (``low``), or None when the re-run did not keep it."""
    if capture is None or not capture.inputs or not ev.inputs:
        return None
    x = ev.inputs[0]
    try:
        w = torch.broadcast_to(capture.inputs[0].double(), ev.bad.shape)[
            ev.bad.to(capture.inputs[0].device)].cpu()
    except RuntimeError:
        return None
    if w.shape != x.shape or not w.numel():
        return None
    return float(w[int(torch.argmin(x))])


def hint(what: str, found: tuple[float, float], dtype: torch.dtype,
         wide: float | None = None) -> str:
    """The ``precision`` hint of such an input; ``wide``: its float64 re-run's value there."""
    low, size = found
    return (f"{what}: that input is a difference of two terms of about {size:.3g} that "
            f"agree to within rounding, left {-low:.3g} below 0 — exact arithmetic keeps it at "
            "or above 0 (a variance written as E[x²] − E[x]² of a feature constant over the "
            "data, a squared distance |a|² + |b|² − 2a·b of coincident points); "
            + _where_rounded(low, size, dtype, wide)
            + ": clamp the difference at 0 before the op (var.clamp_min(0), m2.clamp_min(eps) "
            "before a log), or compute it "
            "without the subtraction (torch.var, Welford's running update, "
            "(a - b).pow(2).sum(-1))")


def _where_rounded(low: float, size: float, dtype: torch.dtype, wide: float | None) -> str:
    """Why the float64 re-run of the step crosses 0 too: its own rounding of terms equal in
    exact arithmetic (a spread of exactly 0, which no type's precision resolves), or the
    terms' (statistics a normaliser accumulated in ``dtype``, kept in buffers)."""
    own = ULPS * torch.finfo(torch.float64).eps * size
    if wide is not None and abs(wide) <= own and abs(wide) < -low / 2:
        return (f"the spread is exactly 0 there: the step re-run in float64 leaves it at "
                f"{wide:.3g}, within float64's own rounding of 0, and crosses 0 where such "
                "terms round the other way, so no wider type fixes a difference of equal terms")
    held = str(dtype).removeprefix("torch.")
    return (f"the terms brought that rounding in ({held} statistics accumulated over earlier "
            "steps in buffers; data stored in that type: a massless particle's four-momentum, "
            "whose m² = E² − |p|² is 0 only to within rounding), so the step re-run in float64 "
            "crosses 0 too")
