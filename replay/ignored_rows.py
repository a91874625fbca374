"""Samples whose every label is the ignore index, where a division made 0/0 on just them.

A per-sequence mean over the scored tokens, ``(logp * mask).sum(-1) / mask.sum(-1)`` with
``mask = labels != -100`` (TRL's ``get_batch_logps(average_log_prob=True)``, IPO's and
SimPO's length-normalised log-probabilities), is 0/0 on a row whose labels are all
``-100``: a preference pair whose chosen equals its rejected (the prompt found as their common
prefix covers both), a prompt longer than the context that truncation left no response of.
The labels are no 0/1 data and may hold every id the others do, so
:mod:`replay.empty_records`'s masks and special tokens miss them: here an integer tensor
holding one negative value (no token id is negative) at every position of exactly the named
rows, while every other row holds a label that is not it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ignored_rows_hint"]


def ignored_rows_hint(report: dict[str, Any], data: list, rows: list[int]) -> bool:
    """Append the label tensors of ``data`` ((name, tensor, sample dim)) ignored at every
    position of exactly ``rows``; whether any was."""
    found = [(name, v) for name, t, d in data if (v := _ignored_in(t, d, rows)) is not None]
    if not found:
        return False
    which = ",".join(str(r) for r in rows)
    names = " and ".join(name for name, _ in found)
    value = found[0][1]
    report["hint"] = (
        f"{report['hint']}. Sample(s) {which} have no scored token: {names} (labels) "
        f"{'is' if len(found) == 1 else 'are'} {value} (the ignore index) at every position "
        "of their rows, and no other sample is ignored everywhere (a response masked away "
        "with its prompt: a preference pair whose chosen equals its rejected, a prompt truncation "
        "left no response of), so a per-sample count of the labels that are not ignored "
        "(mask.sum(-1)) is the 0 divided here; filter such records where the data is made "
        "(the dataset, the collate_fn) or floor the count (mask.sum(-1).clamp_min(1)) "
        f"(--try drop={which} re-runs the step without them)")
    return True


def _ignored_in(t: torch.Tensor, d: int, rows: list[int]) -> int | None:
    """The one negative value of integer ``t`` that fills each of ``rows`` (samples along
    ``d``) while every other row holds something else too; None when there is none."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() < 2 \
            or max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return None
    flat = t.detach().movedim(d, 0).reshape(t.shape[d], -1)
    negative = flat[flat < 0].unique()
    if negative.numel() != 1:
        return None
    value = int(negative)
    ignored = flat.eq(value).all(1)
    named = torch.zeros_like(ignored)
    named[rows] = True
    if bool(ignored[named].all()) and not bool(ignored[~named].any()):
        return value
    return None
