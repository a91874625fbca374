"""The origin's samples as rows of the loader's batch, when the micro-batch was a chunk of it.

A GradCache step (or a loop accumulating ``x.split(k)``) feeds the model row slices of one
batch; the bundle holds the chunk (``micro_batches[i].rows_of``, see ``recorder.chunks``), so
the samples the replay names count from the chunk's first row. The note gives the rows the
user's own batch holds them at.
"""

from __future__ import annotations

from typing import Any

from recorder.chunks import chunk_of

from .load import Step


def chunk_note(step: Step, report: dict[str, Any]) -> None:
    o = report["origin"]
    samples, mb = o.get("samples") or [], o.get("micro_batch") or 0
    entries = step.meta.get("micro_batches") or []
    if not samples or not 0 <= mb < len(entries) or not isinstance(entries[mb], dict):
        return
    rows = chunk_of(entries[mb])
    if rows is None:
        return
    start, of = rows
    n = o.get("batch_size") or 0
    span = f"rows {start} to {start + n - 1}" if n else f"rows from {start}"
    o["batch_rows"] = [start + s for s in samples]
    report["problems"].append(
        f"micro-batch {mb}'s inputs are {span} of a {of}-row tensor the loop sliced them from "
        f"(a chunk of its batch, as GradCache's x.split(chunk_size), or of an in-memory "
        f"dataset): samples {samples} are rows {o['batch_rows']} there")
