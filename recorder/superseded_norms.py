"""Gradient norms a later measure of the same gradients replaced. A backward hook takes each
gradient's squared norm as backward writes it; when the loop changes the gradient before the
update (a GradScaler's ``unscale_``, ``clip_grad_norm_``, the next micro-batch's accumulation)
it is measured again, and the row keeps the first measure unreferenced. A GradScaler's scaled
gradient (65536 times the true one) of a diverging loss can be finite while its squared norm
passes float32's range (above ~1.8e19): +inf in that stale entry, no event, since the
gradients the update used are finite (as the optimizer's own check of them says)."""

from __future__ import annotations

import math

import torch

from .shards import local
from .step_evidence import StepEvidence

__all__ = ["only_superseded_overflow"]


def _referenced(ev: StepEvidence) -> set[int]:
    """The row entries the step's layout names (a ReLU'd slot's ~index as its index)."""
    lay = ev.layout
    refs = [k for _, k in (*lay.grads, *lay.params, *lay.updates)]
    refs += [k for _, a, b in lay.loss for k in (a, b)] + [k for *_, k in lay.out_grads]
    for _, _, _, outs, stats, ins in lay.calls:
        refs += [k for pair in outs for k in pair] + list(stats[:2] if stats else ())
        refs += [k for a, b, _ in ins for k in (a, b)]
    return {~k if k < 0 else k for k in refs}


def only_superseded_overflow(ev: StepEvidence) -> bool:
    """Every non-finite entry of the row is a +inf no field of the layout names (a superseded
    measure), and every live gradient is finite: a squared norm overflowed, nothing else."""
    bad = [i for i, v in enumerate(ev.row) if not math.isfinite(v)]
    if not bad or ev.param_tensors is None or any(ev.row[i] != math.inf for i in bad):
        return False
    if not _referenced(ev).isdisjoint(bad):
        return False
    grads = [local(p.grad) for p in ev.param_tensors if p.grad is not None]
    return all(bool(torch.isfinite(g.detach()).all()) for g in grads if not g.is_sparse)
