"""A forward event whose call took the non-finite value in from the loss's data, after its
micro-batch's root call returned.

A module the loss calls runs outside the root forward: zuko's flows return a distribution
whose transforms are built lazily, and ``flow(c).log_prob(x)`` runs their hyper-networks
(``MaskedMLP``) inside the loss on ``x``, the data the flow models. A NaN record there is
first seen in such a call's output, a module whose inputs were not finite, which no call made:
the value came in with the loss's arguments. :func:`loss_data_taken` names that argument and
its samples, so that the event is an input event of the data, as a non-finite target of the
loss itself is (``events._loss_event``).
"""

from __future__ import annotations

from typing import Any

from .batch_tensors import data_tensors, first_bad_tensor
from .capture import loss_path


def loss_data_taken(ev: Any, d: dict[str, Any]) -> tuple[str, list[int], str] | None:
    """(the loss argument's path, its samples, kind) when decoded call ``d`` took a non-finite
    input after its micro-batch's root call completed, and that micro-batch's loss arguments
    (not the model output) hold a non-finite value; else None."""
    if d["inputs_all_finite"] or d["module"] == 0 or not ev.tape.micro_batches:
        return None
    mb_i = d["micro_batch"]
    root = next((r for r in ev.calls if r["module"] == 0 and r["micro_batch"] == mb_i), None)
    if root is None or root["order"] > d["order"] or mb_i >= len(ev.tape.micro_batches):
        return None  # (inside the root's forward: its own code or a call made it)
    mb = ev.tape.micro_batches[mb_i]
    if mb.loss_args is None and not mb.loss_kwargs:
        return None
    outs = list(data_tensors(mb.outputs))
    found = first_bad_tensor([list(mb.loss_args or ()), mb.loss_kwargs or {}],
                             ev.samples(mb_i), skip=outs, model=(outs, ev.param_tensors))
    if not found:
        return None
    return loss_path(found[0]), found[1], found[2]
