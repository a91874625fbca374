"""Samples that sent back a gradient of exactly 0 into the model's output (a padded record, a
masked label): their per-sample gradients are exactly 0 too, so a loop that divides each
sample's gradient by its norm (DP-SGD's per-sample clip or automatic clipping without an eps,
``g / ‖g‖``) makes 0/0 there. Read from the output gradients the recorder kept, for a backward
event whose NaN gradients the loop wrote by hand."""

from __future__ import annotations

import torch

from recorder.capture import tree_refs

from .load import Step, output_grads
from .recorded import samples


def zero_gradient_rows(step: Step) -> dict[int, list[int]]:
    """Micro-batch -> the samples whose recorded output gradients are all exactly 0 (in every
    output that holds the samples); only micro-batches where some sample's is not."""
    found: dict[int, list[int]] = {}
    for i in range(len(step.micro_batches)):
        zero = zero_mask(step, i)
        if zero is not None and bool(zero.any()) and not bool(zero.all()):
            found[i] = zero.nonzero().flatten().tolist()
    return found


def zero_mask(step: Step, i: int) -> torch.Tensor | None:
    """Per sample of micro-batch ``i``: its recorded output gradients are all exactly 0 (in
    every output that holds the samples); None when no recorded gradient holds them."""
    where = samples(step, i)
    zero: torch.Tensor | None = None
    for g in output_grads(step, i).values():
        d = where.dim(g) if g.is_floating_point() and where.size else None
        if d is None or g.shape[d] != where.size:
            continue
        rows = (g.movedim(d, 0).reshape(where.size, -1) == 0).all(1)
        zero = rows if zero is None else zero & rows
    return zero


def zero_rows_text(found: dict[int, list[int]]) -> str:
    """The hint's sentence on them, '' when there are none."""
    if not found:
        return ""
    parts = [f"{_spans(rows)} of micro-batch {i}" if len(found) > 1 or i else _spans(rows)
             for i, rows in found.items()]
    return (f"; sample(s) {', '.join(parts)} sent back a gradient of exactly 0 into the "
            "model's output (a padded or masked record), so their per-sample gradients are 0 "
            "and a per-sample clip or normalisation that divides by their norm (g / ‖g‖, "
            "C / ‖g‖) makes 0/0 there: add an eps to the norm (‖g‖ + 1e-6), as Opacus's "
            "clip does, or leave those samples out")


def empty_micro_batch(step: Step, i: int) -> bool:
    """Whether micro-batch ``i`` held no sample: its recorded batch size is 0 (which also means
    unknown) and every tensor of its inputs has no element."""
    mb = step.micro_batches[i] if 0 <= i < len(step.micro_batches) else {}
    ts = [step.tensors[k] for k in tree_refs(mb.get("inputs"), "$t") if k in step.tensors]
    return bool(ts) and all(t.numel() == 0 for t in ts) and samples(step, i).size == 0


def empty_batch_text(step: Step) -> str:
    """The hint's sentence when every forward of the step took a batch of no sample (Poisson
    sampling that drew no record), '' otherwise."""
    mbs = step.micro_batches
    if not mbs or not all(empty_micro_batch(step, i) for i in range(len(mbs))):
        return ""
    return ("; the step's batch held no sample (Poisson sampling that drew no record), so "
            "what the loop divides by its size (len(batch) = 0) is ±inf or NaN: divide the "
            "summed, noised gradients by the expected batch size (q · N), as Opacus does, or "
            "skip a step whose batch is empty")


def _spans(rows: list[int]) -> str:
    """[3, 4, 5, 9] as '[3-5, 9]'."""
    out, start = [], rows[0]
    for a, b in zip(rows, rows[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return "[" + ", ".join(out) + "]"
