"""A batch tensor whose samples holding NaN/Inf include copies of one record: two or more
rows equal in every entry, their non-finite values at the same places. The batch drew that
record several times, as a sampler drawing with replacement does (``WeightedRandomSampler``
with class-balanced weights, a class-aware or repeat-factor sampler oversampling the records
of a rare class): one bad record, not a value the pipeline computed for a group of records
(``replay.group_nan``, whose "group" would be the record's own features) nor entries missing
at random across records.
"""

from __future__ import annotations

import torch

REPEATED_RECORD = (
    "the batch itself holds {kind}, and the samples of {tensor} that hold it are copies of "
    "{records}: {groups}, equal in every entry, the {kind} at the same places ({where}): the "
    "batch drew the same record several times, as a sampler drawing with replacement does "
    "(WeightedRandomSampler with class-balanced weights, a class-aware or repeat-factor "
    "sampler oversampling a rare class's records: one bad record of a tail class is met in "
    "many batches); find that record in the dataset (the entries above) and fix or drop it "
    "where it is read or normalised (a truncated or corrupt file, a missing value, a 0/0 of "
    "its own statistics), or check the records once before training "
    "(torch.isfinite(x).all() over the dataset)")

SHOWN = 8  # rows, and entries, named


def _copies(flat: torch.Tensor, rows: list[int]) -> list[list[int]]:
    """``rows`` grouped by equal content (NaN equal to NaN), groups of one left out."""
    groups: list[list[int]] = []
    for r in rows:
        for g in groups:
            if torch.equal(flat[g[0]].nan_to_num(), flat[r].nan_to_num()) and torch.equal(
                    torch.isnan(flat[g[0]]), torch.isnan(flat[r])):
                g.append(r)
                break
        else:
            groups.append([r])
    return [g for g in groups if len(g) > 1]


def _content(row: torch.Tensor) -> bool:
    """Whether ``row``'s finite entries hold two different values: a record's content, not a
    row all NaN or all one fill value (padding, a dead sensor), which many records share."""
    kept = row[torch.isfinite(row)]
    return kept.numel() >= 2 and bool((kept != kept[0]).any())


def repeated_record(t: torch.Tensor | None, d: int | None, kind: str) -> str:
    """``REPEATED_RECORD`` filled (but for ``{tensor}``) when the rows of ``t``'s sample dim
    ``d`` that hold a non-finite value include two or more equal ones with content of their
    own (:func:`_content`); else ""."""
    if t is None or d is None or t.dim() < 2 or not t.is_floating_point() \
            or t.shape[d] < 2:
        return ""
    flat = t.detach().movedim(d, 0).reshape(t.shape[d], -1).float()
    bad = ~torch.isfinite(flat)
    rows = bad.any(1).nonzero().flatten().tolist()
    if len(rows) < 2 or len(rows) > 64:
        return ""
    groups = [g for g in _copies(flat, rows) if _content(flat[g[0]])]
    if not groups:
        return ""
    entries = bad[groups[0][0]].nonzero().flatten().tolist()
    where = "entr" + ("y " if len(entries) == 1 else "ies ") + ", ".join(
        map(str, entries[:SHOWN])) + (", ..." if len(entries) > SHOWN else "") + \
        f" of {flat.shape[1]} per sample"
    text = ["samples " + ", ".join(map(str, g[:SHOWN])) + (", ..." if len(g) > SHOWN else "")
            + f" ({len(g)} copies)" for g in groups[:SHOWN]]
    records = "one record" if len(groups) == 1 else f"{len(groups)} records"
    return REPEATED_RECORD.format(kind=kind, tensor="{tensor}", records=records,
                                  groups="; ".join(text), where=where)
