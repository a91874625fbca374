"""A target distribution the loop built with no mass in some samples' rows, where it divides.

C51's categorical projection of the Bellman target ``r + gamma * z`` splits each atom's mass
between the atoms at ``floor(b)`` and ``ceil(b)``; written without the ``(l == u)`` term, a
target landing exactly on an atom (a terminal transition with a reward of 0) puts its mass on
neither, and the row of a terminal transition is all 0. Renormalised (``p / p.sum(-1)``) it is
0/0. The op took the loss's data alone, which reads as a degenerate record ("fix the dataset"),
but the record is sound: the code that built the target lost the mass. A 0/1 mask with an
empty row is no distribution (it is a degenerate record), so it is not named.
"""

from __future__ import annotations

from typing import Any

import torch

from .edge_probability import loss_args_by_sample, name_divided_data
from .load import Step


def massless_rows_hint(report: dict[str, Any], step: Step) -> None:
    """Replace an ``invalid`` division's degenerate-record advice (:func:`name_divided_data`)
    when a loss argument of the micro-batch holds a distribution per sample
    (:func:`_massless`) whose every named sample's row is all 0."""
    name_divided_data(report, step, _massless, lambda which: (
        f"non-negative weights per sample (a target distribution), holds no mass at "
        f"sample(s) {which}: every entry of their rows is exactly 0, so normalising it "
        "(p / p.sum()) is 0/0 there. The record need not be degenerate: check the code that "
        "built that target for mass it dropped (C51's projection onto the atoms without the "
        "(l == u) term loses a target that lands exactly on an atom, as a terminal "
        "transition's reward of 0 does; a scatter or index_add_ that wrote nothing into the "
        "row), and do not renormalise a target that must already sum to 1"))


def _massless(step: Step, mb: int, rows: list[int]) -> str | None:
    """The readable name of the first floating loss argument of micro-batch ``mb`` holding
    several entries per sample, all non-negative, some strictly between 0 and 1 (no 0/1
    mask), whose rows ``rows`` are all exactly 0 while another sample's row has mass."""
    for name, t, d in loss_args_by_sample(step, mb):
        if t.numel() == t.shape[d] or max(rows) >= t.shape[d] \
                or not bool((t >= 0).all()) or not bool(((t > 0) & (t < 1)).any()):
            continue
        mass = t.movedim(d, 0).reshape(t.shape[d], -1).sum(-1)
        named = torch.zeros_like(mass, dtype=torch.bool)
        named[rows] = True
        if not bool(mass[named].any()) and bool(mass[~named].gt(0).any()):
            return name
    return None
