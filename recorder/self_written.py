"""Weights the step's own code made non-finite in place while every output, the loss and the
gradients stayed finite.

TransE-PyTorch renormalises its entities at the start of ``forward``
(``weight.data[:-1].div_(norm)``): a zero row (a padding entity) is 0/0 there, and no module
output holds the NaN, since no batch looks that row up. The recorder sees the step's
parameters changed (``StepEvidence.changed``: written before the optimizer's first update, or
not the optimizer's) and non-finite: the event names them, not 'no identifiable source'.
"""

from __future__ import annotations

import torch

from .finite import finite, tensors_kind
from .shards import local

__all__ = ["WRITTEN_DETAIL", "self_written"]

WRITTEN_DETAIL = ("parameter {name} was made non-finite during the step by the model's own "
                  "code (written in place, not by the optimizer), while every output, the "
                  "loss and the gradients stayed finite")


def self_written(tensors: list[torch.Tensor] | None, names: list[str], changed: set[int]
                 ) -> tuple[list[str], str] | None:
    """The names and kind of the ``changed`` parameters (indices into ``tensors``) that are
    non-finite now, or None. Slow path only: reads the weights."""
    if tensors is None:
        return None
    bad = [i for i in sorted(changed) if not finite(local(tensors[i]).detach())]
    if not bad:
        return None
    return [names[i] for i in bad], tensors_kind(local(tensors[i]).detach() for i in bad)
