"""The rows of a root input other than the batch that a forward origin's non-finite values
come from. A few-shot model takes a support set beside the query batch (``model(xs, ys, xq)``)
and compares every query with every support sample or class prototype, ``(queries, support)``:
one blank support image makes its column 0/0 for every query, so every sample of the batch is
non-finite, and naming them all says nothing. When the op's non-finite values fill every
sample's row at a few indices of its dim 1 only, and a floating root input has as many rows as
that dim (and the batch another size), those rows of that input are named: floating rows, or
token ids of 2 or more dims (a retriever's passages beside its queries; a 1-d integer tensor
is labels). Dims after 1 are folded into it (ColBERT's MaxSim per query token,
``(queries, passages, query tokens)``). So are the rows of
the op's own dim 0 when no sample was named and only one root input has that many rows (a
NegCLIP batch: B images beside 2B captions, the B hard negatives after the B true ones)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from recorder.capture import batch_path

from .load import Step
from .recorded import n_args, samples


def other_input_rows(step: Step, hit, mb: int) -> tuple[str, list[int]] | None:
    """(the input's readable name, its rows) for the op ``hit`` of micro-batch ``mb``, or
    None (see the module docstring)."""
    ev = hit.evidence if hit is not None else None
    bad = ev.bad if ev is not None else hit.grid if hit is not None else None
    size = samples(step, mb).size
    if bad is None or bad.dim() < 2 or not size or bad.shape[0] != size:
        return None
    bad, n = bad.cpu(), bad.shape[1]
    bad = bad.flatten(2).any(2) if bad.dim() > 2 else bad
    cols = bad.any(0).nonzero().flatten().tolist()
    if n == size or not bool(bad.any(1).all()) or not cols or len(cols) > n // 2:
        return None  # (not every sample's row, or no few indices of dim 1)
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    for key, raw in (entry.get("paths") or {}).items():
        t = step.tensors.get(key)
        if t is not None and _compared_rows(t) and t.shape[0] == n:
            return batch_path(raw, count), cols
    return None


def _compared_rows(t: torch.Tensor) -> bool:
    return t.dim() > 0 and (t.is_floating_point() or (t.dim() > 1 and not t.is_complex()))


def bad_grid(t) -> torch.Tensor | None:
    """A reduction's non-finite places over its output's first two dims, on its device (no
    host read: only :func:`other_input_rows` reads it, at the blamed op)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_floating_point():
        return None
    with torch.no_grad():
        bad = ~torch.isfinite(t.detach())
        return bad.flatten(2).any(2) if bad.dim() > 2 else bad


def lead_rows(t) -> tuple[int, list[int]] | None:
    """(dim 0's size, its indices holding a non-finite value) of an op's output (one host
    read, at the blamed op only)."""
    if not isinstance(t, torch.Tensor) or not t.dim() or not t.is_floating_point():
        return None
    with torch.no_grad():
        return _rows(~torch.isfinite(t.detach()))


def _rows(bad: torch.Tensor) -> tuple[int, list[int]] | None:
    if not bad.dim():
        return None
    return bad.shape[0], bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist()


def own_rows(step: Step, hit, mb: int) -> tuple[str, list[int]] | None:
    """(the input's readable name, its rows) when the op's non-finite values lie in a few rows
    of its dim 0, which has the size of one root input's dim 0 only, not the batch's."""
    size = samples(step, mb).size
    ev = hit.evidence if hit is not None else None
    lead = _rows(ev.bad.cpu()) if ev is not None else hit.lead_rows if hit else None
    if lead is None or not size or lead[0] == size:
        return None
    n, rows = lead
    entry = step.micro_batches[mb]
    paths = entry.get("paths") or {}
    found = [raw for key, raw in paths.items() if (t := step.tensors.get(key)) is not None
             and t.dim() and t.shape[0] == n]
    if not rows or len(rows) == n or len(found) != 1:
        return None
    return batch_path(found[0], n_args(entry.get("inputs"))), rows


def note_other_rows(report: dict[str, Any], step: Step, hit, origin: dict[str, Any]) -> None:
    """Name those rows in ``origin["input_rows"]`` and in a note, when there are some."""
    mb = origin.get("micro_batch") or 0
    found = other_input_rows(step, hit, mb)
    # (samples named by the call's output, not by the op's rows: a dual encoder's 0/0 in its
    # passage embeddings (2B rows) leaves every query's score row NaN)
    if found is None and not (origin.get("samples") and hit is not None and hit.rows):
        if (own := own_rows(step, hit, mb)) is not None:
            name, rows = own
            origin["input_rows"] = {"tensor": name, "rows": rows}
            report["problems"].append(
                f"the {hit.made} of {hit.op} is in rows {rows} of its dim 0, which has as many "
                f"entries as {name} has rows (the batch is the other size): rows {rows} of "
                f"{name} are where it comes from (a second input beside the batch: extra "
                "candidates, hard negatives)")
        return
    if found is None:
        return
    name, rows = found
    origin["input_rows"] = {"tensor": name, "rows": rows}
    report["problems"].append(
        f"every sample's row holds the {hit.made} of {hit.op} only at {rows} of its dim 1, "
        f"which has as many entries as {name} has rows (the batch is the other size): rows "
        f"{rows} of {name} are where it comes from (a support set's samples, a retriever's "
        "passages, compared with every query: a blank record, a class with none)")


def note_grad_rows(report: dict[str, Any], step: Step, found, origin: dict[str, Any]) -> None:
    """A backward origin's: the node's non-finite gradient, naming no sample, in a few rows of
    its dim 0 that has the size of one root input's (a dual encoder's passage tower, ``2B``
    rows beside ``B`` queries: the zero vector of a blank passage under a hand-written norm)."""
    if origin.get("samples") or found.lead_rows is None:
        return
    mb = origin.get("micro_batch") or 0
    own = own_rows(step, SimpleNamespace(evidence=None, lead_rows=found.lead_rows), mb)
    if own is None:
        return
    name, rows = own
    origin["input_rows"] = {"tensor": name, "rows": rows}
    report["problems"].append(
        f"the {found.made} gradient {found.node} returned is in rows {rows} of its dim 0, "
        f"which has as many entries as {name} has rows (the batch is the other size): rows "
        f"{rows} of {name} are where it comes from (a second input beside the batch: extra "
        "candidates, hard negatives)")
