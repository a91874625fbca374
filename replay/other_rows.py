"""The rows of a root input other than the batch that a forward origin's non-finite values
come from. A few-shot model takes a support set beside the query batch (``model(xs, ys, xq)``)
and compares every query with every support sample or class prototype, ``(queries, support)``:
one blank support image makes its column 0/0 for every query, so every sample of the batch is
non-finite, and naming them all says nothing. When the op's non-finite values fill every
sample's row at a few indices of its dim 1 only, and a floating root input has as many rows as
that dim (and the batch another size), those rows of that input are named."""

from __future__ import annotations

from typing import Any

from recorder.capture import batch_path

from .load import Step
from .recorded import n_args, samples


def other_input_rows(step: Step, hit, mb: int) -> tuple[str, list[int]] | None:
    """(the input's readable name, its rows) for the op ``hit`` of micro-batch ``mb``, or
    None (see the module docstring)."""
    ev = hit.evidence if hit is not None else None
    size = samples(step, mb).size
    if ev is None or ev.bad.dim() != 2 or not size or ev.bad.shape[0] != size:
        return None
    bad, n = ev.bad.cpu(), ev.bad.shape[1]
    cols = bad.any(0).nonzero().flatten().tolist()
    if n == size or not bool(bad.any(1).all()) or not cols or len(cols) > n // 2:
        return None  # (not every sample's row, or no few indices of dim 1)
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    for key, raw in (entry.get("paths") or {}).items():
        t = step.tensors.get(key)
        if t is not None and t.is_floating_point() and t.dim() and t.shape[0] == n:
            return batch_path(raw, count), cols
    return None


def note_other_rows(report: dict[str, Any], step: Step, hit, origin: dict[str, Any]) -> None:
    """Name those rows in ``origin["input_rows"]`` and in a note, when there are some."""
    found = other_input_rows(step, hit, origin.get("micro_batch") or 0)
    if found is None:
        return
    name, rows = found
    origin["input_rows"] = {"tensor": name, "rows": rows}
    report["problems"].append(
        f"every sample's row holds the {hit.made} of {hit.op} only at {rows} of its dim 1, "
        f"which has as many entries as {name} has rows (the batch is the other size): rows "
        f"{rows} of {name} are where it comes from (a support set's samples compared with "
        "every query: a blank record, a class with none)")
