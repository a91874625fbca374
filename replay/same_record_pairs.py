"""A distance at 0 between samples that are the same record.

A triplet or contrastive loss over embeddings of one batch (anchors, positives and negatives
as its thirds) takes ``sqrt(((a - p) ** 2).sum(-1))``; where a pair's two texts are one text
(a deduplication miss, an augmentation that changed nothing, dropout off) the embeddings are
equal bit for bit, the distance is exactly 0 and the derivative of sqrt infinite there. The
sqrt pole's hint lists the ways points coincide; the samples named come in pairs whose every
model input is equal row for row, so :func:`same_record_pairs_hint` names the pairs and their
inputs: the data pairs a record with itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .cause_text import DO
from .empty_records import batch_data
from .load import Step

_SQRT_POLE = DO["sqrt_pole"][2:40]  # (the clause's start, as the hint holds it)


def same_record_pairs_hint(report: dict[str, Any], step: Step) -> None:
    """Append the pairs of named samples whose model inputs are equal in every tensor, where
    an ``invalid`` backward origin at a sqrt's pole names them all so."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows = o.get("samples") or []
    if report.get("cause") != "invalid" or o.get("phase") != "backward" \
            or _SQRT_POLE not in hint or not 2 <= len(rows) <= 16:
        return
    data = [(name, t.detach().movedim(d, 0)) for name, t, d in
            batch_data(step, o.get("micro_batch") or 0, loss=False)]
    if not data or any(max(rows) >= t.shape[0] for _, t in data):
        return
    pairs = _pairs(rows, [t for _, t in data])
    if pairs is None or all(not bool(t[rows].ne(0).any()) for _, t in data):
        return  # (blank rows, all 0: padding, which the pole's hint names)
    said = ", ".join(f"{a} and {b}" for a, b in pairs)
    names = ", ".join(name for name, _ in data)
    report["hint"] = (
        f"{hint}. Here the samples named are the same record in pairs ({said}: {names} equal "
        "row for row), so the points coincide exactly: the data pairs a record with itself "
        "(an anchor whose positive is its own text: a deduplication miss, an augmentation "
        "that changed nothing); drop or re-draw such pairs where the pairs are made, and take "
        "the distance with torch.linalg.vector_norm, whose gradient at 0 is 0")


def _pairs(rows: list[int], tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """``rows`` split into pairs of samples equal in every tensor, or None."""
    left, pairs = sorted(rows), []
    while left:
        a = left.pop(0)
        b = next((b for b in left if all(torch.equal(t[a], t[b]) for t in tensors)), None)
        if b is None:
            return None
        left.remove(b)
        pairs.append((a, b))
    return pairs
