"""The batch of the step where a rewind window shows the trouble began, when it held rows out
of scale.

A corrupt record (a regression target of 1e17 where the others are below 300: a value in the
wrong unit, a parser's garbage) makes a finite but enormous loss at its step; plain SGD's update
blows the weights up, and the overflow comes steps later, on clean batches. The window's report
says the loss jumped at that step and to fix "a bad batch"; this note looks at that step's own
batch (the window keeps it) and names the rows of its model inputs and loss data whose largest
value is 100x the median row's, and the records they are where the batch carries ids
(``replay.record_ids``). Not at the event step's batch (``replay.data_scale`` looks there), and
not where most rows are large (the model's scale, not a record's).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path, loss_path

from .load import Step
from .record_ids import identifiers, short
from .recorded import n_args

_FACTOR = 100.0  # a row's largest value over the median row's


def began_batch_note(report: dict[str, Any], step: Step) -> None:
    began = (report.get("window") or {}).get("precursors_began") or {}
    at, event_step = began.get("step"), report["event"].get("step")
    if at is None or event_step is None or at >= event_step \
            or began.get("kind") not in ("loss_jump", "grad_norm_jump"):
        return
    record = next((r for r in ((step.meta.get("rewind") or {}).get("records") or [])
                   if isinstance(r, dict) and r.get("step") == at), None)
    if record is None:
        return
    said = []
    for entry in record.get("micro_batches") or []:
        said += list(_outliers(step, entry))
    if said:
        report["problems"].append(
            f"step {at}, where the rewind window shows the trouble began, fed rows out of "
            f"scale: {'; '.join(said)}: a corrupt record or a value in another unit, whose "
            "update drove the weights there; fix or filter it where the data is made")


def _outliers(step: Step, entry: dict):
    """One clause per data tensor of the micro-batch ``entry`` with rows out of scale."""
    count, made = n_args(entry.get("inputs")), set(entry.get("loss_grad_args") or ())
    named = [(k, batch_path(raw, count)) for k, raw in (entry.get("paths") or {}).items()]
    named += [(k, loss_path(raw)) for k, raw in (entry.get("loss_paths") or {}).items()
              if k not in made]
    tensors = [(name, step.tensors.get(k)) for k, name in named]
    tensors = [(name, t) for name, t in tensors if isinstance(t, torch.Tensor)
               and t.is_floating_point() and t.dim() >= 1 and t.numel()]
    if not tensors:
        return
    n = tensors[0][1].shape[0]  # (the first model input's rows: the samples)
    for name, t in tensors:
        if n < 4 or t.shape[0] != n or not bool(torch.isfinite(t).all()):
            continue
        top = t.detach().double().abs().reshape(n, -1).amax(1)
        med = float(top.median())
        rows = (top >= _FACTOR * med).nonzero().flatten().tolist() if med > 0 else []
        if not rows or len(rows) > n // 2:
            continue
        peak = float(top[rows].max())
        ids = "; ".join(f"{k} = {short([v[r] for r in rows])}"
                        for k, v in identifiers(step, entry, n))
        yield (f"{name} rows {short(rows)} reach {peak:.3g}, {peak / med:.3g}x the median "
               f"row's largest {med:.3g}" + (f" (the records: {ids})" if ids else ""))
