"""Infinities an op took back to the finite values exact arithmetic gives too: a clamp, a
minimum, a row's min or a ``where`` that keeps the other branch turns +inf into the same bound
or value it turns a huge finite number into. An unrolled solver's fraction-to-the-boundary
step ``(0.99 * (s / Gdz).min(1)).clamp(max=1)`` overflows in ``s / Gdz`` as its step shrinks and
clamps it back to 1 every time; a NaN made later of finite values (the barrier parameter
``t`` past float32's range times a 0) is the origin, not that overflow; so is an infinity
made later of finite values before any NaN (``superseded``: PyG's ``gcn_norm`` takes
``deg.pow(-0.5)`` of a padded node's degree 0 and fills its +inf with 0, then a graph's
features out of scale overflow the encoder's ``exp(logvar)``). A 0 made of an
infinity (``1 / inf``, ``exp(-inf)``) is not exact unless the infinity was (``exact_pole``)."""

from __future__ import annotations

from typing import Any

from .hits import exact_pole

# ops whose result on +-inf is the one on any value beyond their bound or not picked
_SATURATING = {"clamp", "clamp_", "clamp_max", "clamp_max_", "clamp_min", "clamp_min_",
               "clip", "clip_", "minimum", "maximum", "fmin", "fmax", "min", "max", "amin",
               "amax", "where", "hardtanh", "hardtanh_"}


def took_back(f: Any, name: str, took: bool) -> None:
    """Note on the finder ``f`` that op ``name`` made finite values of the infinities it was
    given (``took``), and whether it was one that saturates (``_SATURATING``)."""
    f.absorbed |= took
    f.unsaturated |= took and name not in _SATURATING


def taken_back_exactly(f: Any) -> bool:
    """Whether the finder's first infinity was taken back to finite values before its first
    NaN, and the values it became are exact: an exact pole's, or only saturating ops took
    infinities back (a clamp of an overflow)."""
    return f.absorbed and f.first is not None and (exact_pole(f.first) or not f.unsaturated)


def superseded(f: Any) -> bool:
    """Whether the finder's first infinity was taken back exactly (:func:`taken_back_exactly`)
    before any NaN, so that a non-finite value made later of finite ones starts the chain
    instead; the caller then replaces ``f.first`` with that op, whose infinities are not
    taken back yet."""
    if f.first_nan is not None or not taken_back_exactly(f):
        return False
    f.absorbed = f.unsaturated = False
    return True
