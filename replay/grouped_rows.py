"""An input with one row per group of the batch's rows: a preference pair's margin, ``(B,)``,
beside a batch that concatenates the pairs' chosen then rejected completions, ``(2B, T)``, as
TRL's ``RewardTrainer`` and ``DPOTrainer`` build it (``torch.cat([chosen, rejected])``). Its
dim 0 is no sample dimension of the batch, so its non-finite rows were read as a table every
sample goes through ('no sample to blame'); they are records, each standing for the rows
``r, r + B, ...`` of the batch."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import bad_rows

GROUPED = (
    "the input {tensor} holds NaN/Inf in its rows {rows} (of {n}): it has one row per group of "
    "{k} of the batch's {size} rows, which concatenates {k} blocks of {n} (the chosen, then the "
    "rejected completions of preference pairs, as TRL's RewardTrainer and DPOTrainer build "
    "them), so its row r stands for the batch's rows r, r + {n}, ...: {samples}; fix or filter "
    "those records where the column is made (a missing rating, a division by zero)")


def grouped(t: torch.Tensor, size: int | None) -> dict[str, Any] | None:
    """``t``'s non-finite rows and the batch rows they stand for, where ``t`` holds one value
    per row of its dim 0, which divides the batch size ``size`` into two or more blocks; None
    otherwise."""
    if not size or t.dim() < 1 or not t.is_floating_point():
        return None
    n = int(t.shape[0])
    # (one value per group: records with features of their own beside the batch, a few-shot
    # episode's support set, are no group of its rows)
    if n < 2 or n >= size or size % n or t.numel() != n:
        return None
    rows = bad_rows(t, 0)
    if not rows:
        return None
    k = size // n
    return {"rows": rows, "of": n, "blocks": k,
            "samples": sorted(r + j * n for r in rows for j in range(k))}


def grouped_hint(tensor: str, g: dict[str, Any], size: int) -> str:
    return GROUPED.format(tensor=tensor, rows=g["rows"], n=g["of"], k=g["blocks"], size=size,
                          samples=g["samples"])
