"""Samples padded with whole units, whose padding units reached a softmax as rows of their own.

A hierarchical model pads each document to a fixed number of sentences (each sentence to a
fixed number of words: token ids ``(B, S, W)``) and runs its word level over the ``B * S``
sentences flattened into rows: a padding sentence is a row whose every word is masked, and the
word attention's softmax is NaN there. The samples named are exactly those holding a padding
unit (the short documents), which the fully-masked-row advice (keep a key per row, a finite
mask value) leaves unexplained: the hint names the input, the units and the fix (run the lower
level over the non-empty units only, and scatter their vectors back).

A 0/1 mask the model was given whose rows (along its last dim, the entries it gates) are all 0
in exactly the named samples is the masked rows themselves, and comes first: an available-
action mask with no action left for an agent (a dead agent whose no-op the environment does
not mark available), whose logits a policy filled with -inf; integer ids that are 0 in the
same samples (that agent's no-op actions) are then no padding units.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .empty_records import batch_data
from .load import Step

_MASKED_ROW = "(a fully masked row)"  # (replay.plus_inf_row's softmax of a row of -inf)
_SAID = ("Sample(s) ", "sample(s) ")  # (the records named already: replay.zero_records)


def padded_units_hint(report: dict[str, Any], step: Step) -> None:
    """Append the integer model input whose all-0 units are in exactly the named samples."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or not rows or _MASKED_ROW not in hint \
            or any(said in hint for said in _SAID):
        return
    data = list(batch_data(step, mb, loss=False))
    for name, t, d in data:
        if where := _empty_mask_rows(t, d, rows):
            report["hint"] = (
                f"{hint}. Sample(s) {','.join(str(r) for r in rows)} hold rows of {name}, a 0/1 "
                f"mask given to the model, that are 0 at every entry ({where}), and no other "
                "sample does: each such row masks every entry it gates (an available-action "
                "mask with no action left: a dead or finished agent whose no-op the "
                "environment does not mark available; an attention mask with no key): give "
                "every row at least one allowed entry (mark the no-op available), or skip "
                "those rows (select the live ones, fill their output after)")
            return
    for name, t, d in data:
        units = _padding_units(t, d, rows)
        if units:
            which = ",".join(str(r) for r in rows)
            only = ", and no other sample does," if len(rows) < t.shape[0] else ""
            report["hint"] = (
                f"{hint}. Sample(s) {which} hold{only} units of {name} "
                f"that are padding throughout ({units}: a document padded to a fixed number "
                "of whole sentences, a bag padded to a fixed number of sequences): the lower "
                "level ran over those padding units as rows of their own, each with every "
                "position masked; run it over the non-empty units only (x[lengths > 0]) and "
                "scatter their vectors back into zeros")
            return


def _padding_units(t: torch.Tensor, d: int, rows: list[int]) -> str:
    """For integer ids ``t`` of 3 or more dims, samples along ``d``: the units (index along
    the next dim) all 0 in each of ``rows`` (``"sample 2, unit(s) 1, 2"``), when exactly
    ``rows`` have such a unit (every sample, may be) and none of them is all 0; else ``""``."""
    if t.is_floating_point() or t.dtype == torch.bool or t.dim() < 3 or d != 0 \
            or max(rows) >= t.shape[0]:
        return ""
    empty = t.detach().reshape(t.shape[0], t.shape[1], -1).eq(0).all(-1)  # (B, units)
    having = empty.any(1)
    named = torch.zeros_like(having)
    named[rows] = True
    if not torch.equal(having, named) or bool(empty[named].all(-1).any()):
        return ""
    return "; ".join(f"sample {r}, unit(s) {', '.join(map(str, empty[r].nonzero()[:, 0].tolist()))}"
                     for r in rows[:4])


def _empty_mask_rows(t: torch.Tensor, d: int, rows: list[int]) -> str:
    """For a 0/1 tensor ``t`` of 3 or more dims, samples along ``d`` (0): its rows along the
    last dim that are all 0 in each of ``rows`` (``"sample 2, at (1, 0), (3, 2)"``), when
    exactly ``rows`` have such a row and not every entry of theirs is 0; else ``""``."""
    if t.dim() < 3 or d != 0 or max(rows) >= t.shape[0] or t.shape[-1] < 2 \
            or t.is_complex() or not zero_one(t):
        return ""
    empty = t.detach().reshape(t.shape[0], -1, t.shape[-1]).eq(0).all(-1)  # (B, rows)
    having = empty.any(1)
    named = torch.zeros_like(having)
    named[rows] = True
    if not torch.equal(having, named) or bool(empty[named].all(-1).any()):
        return ""
    inner = t.shape[1:-1]
    return "; ".join(
        f"sample {r}, at " + ", ".join(
            str(tuple(int(k) for k in torch.unravel_index(torch.tensor(i), inner)))
            for i in empty[r].nonzero()[:3, 0].tolist())
        + (" ..." if int(empty[r].sum()) > 3 else "") for r in rows[:3])
