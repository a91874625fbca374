"""A loss argument with a value per pair or group of samples, not per sample.

A reward model scores each pair's chosen and rejected answers in one concatenated batch
(``2n`` rows) and takes the pair's rating gap (``n`` values) as ``margin``; a rating missing
from the data is NaN. That tensor has no dimension of the batch's samples, so the event named
no samples and the hint said it was a shared argument, "a per-class weight", no sample to
blame. One backward of the loss alone says which rows of the model output its value reaches:
when only some, those samples' records made it, and they are named.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path
from recorder.finite import kind_of, label

from .coupled import loss_grad_rows
from .load import Step, differentiates_model
from .rerun import Runner

GROUPED_ARG = (
    "{tensor} (shape {shape}) has no row per sample of the model's {n}-row batch, but its {kind} "
    "reaches the gradient of the model output in rows {rows} only: it holds a value per pair or "
    "group of samples (a preference pair's rating gap, a prompt's group reward), and the "
    "records of these samples made it {kind} (a missing rating, a failed reward call): fix or "
    "filter them in the data pipeline, or leave such pairs out of the loss")


def grouped_arg_hint(report: dict[str, Any], step: Step) -> None:
    """Names the samples of an input event on a loss argument without sample rows whose
    non-finite value reaches some rows of the model output only, and says why."""
    o = report.get("origin") or {}
    tensor = o.get("tensor") or ""
    if o.get("phase") != "input" or o.get("samples") or not tensor.startswith("loss_") \
            or step.model is None or step.loss_fn is None or not step.micro_batches:
        return
    mb = o.get("micro_batch") or 0
    t = next((step.tensors.get(k) for k, raw in
              (step.micro_batches[mb].get("loss_paths") or {}).items()
              if loss_path(raw) == tensor), None)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or not t.is_floating_point():
        return
    rows, n = _reached_rows(step, mb)
    if rows and len(rows) < n:
        # (grouped: a drop of those rows would leave the argument's own rows as they are, so
        # --try auto proposes none)
        o["samples"], o["grouped"] = rows, True
        report["hint"] = GROUPED_ARG.format(tensor=tensor, shape=tuple(t.shape), n=n,
                                            kind=label(kind_of(t)), rows=rows)


def _reached_rows(step: Step, mb: int) -> tuple[list[int], int]:
    """(the samples whose rows of the model output get a non-finite gradient from micro-batch
    ``mb``'s loss, the batch's size); ([], 0) when that cannot be told."""
    if differentiates_model(step, mb):  # (before the re-run: it would tell nothing)
        return [], 0
    try:
        run = Runner(step).run(backward=False, instrument=False)
    except Exception:
        return [], 0
    got = loss_grad_rows(step, run, mb)
    return ([], 0) if got is None else (got[0], got[1].size or 0)
