"""Rows a loss couples to the samples that made its non-finite value: DPO's loss takes the
difference of a chosen row and its rejected row (the two halves of one concatenated batch), a
group-normalised reward (GRPO) the rows of one prompt. Dropping the named row alone leaves its
partner unpaired (the halves then differ in length, and the loss's code raises); dropping the
rows whose gradient of the model output is non-finite drops whole pairs or groups."""

from __future__ import annotations

import torch

from recorder.capture import tensor_leaves
from recorder.samples import Samples

from .load import Step, autocast_as_recorded, differentiates_model, loss_inputs
from .recorded import samples
from .run_result import Run


def coupled_rows(step: Step, run: Run, mb: int, named: list[int]) -> list[int]:
    """The samples whose rows of the model output get a non-finite gradient from the loss,
    when they hold ``named`` and more (else []): one backward of the loss alone, paid only
    by a loss event with named samples."""
    got = loss_grad_rows(step, run, mb) if named else None
    if got is None:
        return []
    rows, where = got
    if not (set(named) < set(rows) and 2 * len(rows) <= where.size):
        return []
    outputs = [[t.detach() for t in o] for o in run.outputs]
    own = _own_rows(step, mb, outputs, run, where, named)
    return [] if set(rows) - set(named) <= own else rows


def loss_grad_rows(step: Step, run: Run, mb: int) -> tuple[list[int], Samples] | None:
    """(the samples whose rows of micro-batch ``mb``'s model output, as ``run`` made it, get
    a non-finite gradient from the loss alone, that micro-batch's samples): one backward of
    the loss over the outputs detached. None where it cannot be told: a loss given the model,
    no floating output, a loss that takes no gradient here."""
    if differentiates_model(step, mb) or mb >= len(run.outputs):
        return None
    outputs = [[t.detach() for t in o] for o in run.outputs]
    leaves = [t.requires_grad_() for t in outputs[mb] if t.is_floating_point()]
    if not leaves:
        return None
    try:
        args, kwargs = loss_inputs(step, mb, outputs, objects=run.objects)
        with torch.enable_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                       loss=True):
            loss = [t for t in tensor_leaves(step.loss_fn(*args, **kwargs))
                    if t.requires_grad and t.is_floating_point()]
            grads = torch.autograd.grad([t.sum() for t in loss], leaves, allow_unused=True)
    except Exception:  # (a loss that takes no gradient here)
        return None
    where = samples(step, mb)
    return sorted({r for g in grads if g is not None for r in where.rows(g)}), where


def _own_rows(step: Step, mb: int, outputs, run: Run, where, named: list[int]) -> set[int]:
    """The rows whose gradient stays non-finite with the ``named`` rows left out of the model
    output (a per-row loss: gBCE's pow of a sigmoid near 0 overflowing in its backward, no
    pair): no coupling. Empty where the loss cannot take the rows left out (a pair's halves,
    targets of the full batch)."""
    keep = [r for r in range(where.size) if r not in set(named)]
    try:
        dims = [where.dim(t) for t in outputs[mb]]
        cut = list(outputs)  # (the other micro-batches' as they were)
        cut[mb] = [t if d is None else t.index_select(d, torch.tensor(keep))
                   for t, d in zip(outputs[mb], dims)]
        leaves = [(t.requires_grad_(), d) for t, d in zip(cut[mb], dims)
                  if t.is_floating_point()]
        args, kwargs = loss_inputs(step, mb, cut, objects=run.objects)
        with torch.enable_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                       loss=True):
            loss = [t for t in tensor_leaves(step.loss_fn(*args, **kwargs))
                    if t.requires_grad and t.is_floating_point()]
            grads = torch.autograd.grad([t.sum() for t in loss], [t for t, _ in leaves],
                                        allow_unused=True)
    except Exception:  # (no coupling to rule out)
        return set()
    return {keep[j] for g, (_, d) in zip(grads, leaves) if g is not None and d is not None
            for j in (~torch.isfinite(g)).movedim(d, 0).flatten(1).any(1).nonzero().flatten()
            .tolist()}
