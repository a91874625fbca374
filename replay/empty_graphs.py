"""Graphs with no node, where a division made 0/0 on their samples.

A graph batch concatenates its graphs node by node and names each node's graph in an
assignment vector (PyG's ``batch``); a graph with no node holds no row there, only its entry in
the per-graph tensors. A structure whose atoms a filter removed, or a frame a parser read as
empty, then has an energy of 0 (a sum over no atom) and a count of 0 atoms, so the per-atom
energy ``(pred - target) / n_atoms`` is 0/0 there, as is a mean pooling over its nodes. The
op's advice (an eps) is one fix; the hint adds that the named samples have no node, so the
user can filter such graphs where they are made.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .load import Step
from .recorded import samples

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}
# what replay.raw_pole says of a divisor the batch holds as given
RAW = "is the batch's own data"


def empty_graphs_hint(report: dict[str, Any], step: Step) -> None:
    """Append that the samples of an ``invalid`` 0/0 division are graphs with no node while
    every other graph of the batch has one."""
    o = report.get("origin") or {}
    rows, mb, hint = o.get("samples") or [], o.get("micro_batch") or 0, report.get("hint") or ""
    # (a divisor that is the batch's own count, n_atoms: the raw-pole hint's "by 0", a 0/0)
    raw = RAW in hint and o.get("made") == "nan"
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or o.get("all_samples") or ("0 by 0" not in hint and not raw) \
            or "empty records" in hint or mb >= len(step.micro_batches):
        return
    where = samples(step, mb)
    seg = where.segments
    if seg is None or not where.size or max(rows) >= where.size:
        return
    nodes = torch.bincount(seg.ids.detach().cpu().long(), minlength=where.size)[:where.size]
    named = torch.zeros(where.size, dtype=torch.bool)
    named[rows] = True
    if bool((nodes[named] == 0).all()) and bool((nodes[~named] > 0).all()):
        which = ",".join(str(r) for r in rows)
        if raw:  # (its advice, to fill a missing value, is not for a count of no nodes)
            held = m.group(1) if (m := re.search(r"\(([^():]+): the model's input", hint)) else ""
            hint = (f"{o['op']} of 0 by 0 (0/0): its divisor is the batch's own data"
                    + (f" ({held})" if held else "") + ", 0 in the samples named")
        report["hint"] = (
            f"{hint}. Sample(s) {which} are empty graphs: the batch's assignment vector "
            "(PyG's batch) gives them no node while every other graph has some (a structure "
            "with no atoms, a frame a filter or a parser emptied), so a count or a sum over "
            "their nodes is the 0 divided here; filter such graphs where the data is made "
            "(the dataset, the collate_fn) or floor the count (n_atoms.clamp_min(1))")
