"""Records whose data is all 0, where a log made -inf (or a division x/0) on their samples.

A count model takes the log of a record's total: scVI's observed library size
``log(x.sum(1))``, a size factor, a read depth. A cell with no counts (an empty droplet that
passed QC) has a total of 0, so its library is -inf, its mean ``exp(library) * softmax`` is 0
in every gene, and a likelihood's ``log(mu)`` without an eps is -inf there. The op's advice
(an eps) is one fix; the hint adds that the named samples' counts are all 0 in a real-valued,
non-negative batch tensor while every other sample has some, so the user can filter such
records where the data is made (``replay.empty_records`` says the same of 0/1 masks at 0/0).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from recorder.capture import batch_path
from recorder.finite import zero_one

from .data_divisor import ADVICE
from .empty_records import zero_rows
from .load import Step
from .positive_counts import ADVICE as POSITIVES
from .recorded import n_args, samples

_POLES = ("of 0 (log", "by 0 (x/0", "of 0 by 0")  # (a log's pole, a division's)


def root_inputs(step: Step, mb: int, scalars: bool = False
                ) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(readable name, tensor, sample dim) of micro-batch ``mb``'s floating root inputs;
    ``scalars``: also those holding one value per sample (a focal length)."""
    if mb >= len(step.micro_batches):
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    count = n_args(entry.get("inputs"))
    for key, raw in (entry.get("paths") or {}).items():
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                and (d := where.dim(t)) is not None and (scalars or t.numel() > t.shape[d]):
            yield batch_path(raw, count), t, d


def empty_counts_hint(report: dict[str, Any], step: Step) -> None:
    """Append the non-negative data all 0 in exactly the samples of an ``invalid`` pole."""
    o = report.get("origin") or {}
    rows, hint = o.get("samples") or [], report.get("hint") or ""
    if report.get("cause") != "invalid" or not rows or o.get("all_samples") \
            or not any(p in hint for p in _POLES) or "empty records" in hint \
            or ADVICE in hint or POSITIVES in hint:  # (a loss's divisor of its own data)
        return
    names = [name for name, t, d in root_inputs(step, o.get("micro_batch") or 0)
             if _empty_in(t, d, rows)]
    if names:
        which = ",".join(str(r) for r in rows)
        report["hint"] = (
            f"{hint}. Sample(s) {which} hold no counts: {' and '.join(names)} is 0 in every "
            "entry of their rows and not in any other sample's (a cell with no UMIs, an "
            "empty document, a record filtering emptied), so a total over them (a library "
            "size, a depth) is 0, and what is made of it (its log, a mean scaled by it) is "
            "-inf or 0 there; filter "
            "such records where the data is made (min_counts / min_genes quality control, "
            f"the dataset) (--try drop={which} re-runs the step without them)")


def _empty_in(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` holds counts (non-negative integers) and is not 0/1 data, all 0 in ``rows``, not
    in any other row."""
    if max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return False
    x = t.detach().movedim(d, 0).reshape(t.shape[d], -1)
    # (a crystal's cell beside a molecule's zeros is no count: its volume, not a total, is 0)
    return bool((x >= 0).all()) and not zero_one(x) \
        and bool((x == x.round()).all()) and zero_rows(x, 0, rows)
