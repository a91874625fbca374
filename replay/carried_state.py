"""A recurrent state the loop carries between truncated-BPTT segments is no data.

``logits, state = model(x, state)``, then ``state = [s.detach() for s in state]``: the state is
a root input of the next step, but the model made it. An xLSTM whose exponential gates lost
their log-space stabilizer grows its ``c``, ``n`` segment after segment until ``f * c``
overflows; the rows whose state grew fastest then stand out of the batch, and the outlier
reading (:mod:`replay.outliers`) called them corrupt records to drop. A root input (not the
first positional one) whose shape one of the model's later outputs has again is such a state:
left out of the outlier search, and named, when it already held a value near the type's range,
as a state the recurrence let grow across segments.

The same state tells a padded row of a later segment from a blank record: a Transformer-XL's
memory and its padding mask passed back in, a shorter piece of the batch ends in an earlier
segment, and its row of this one is padding throughout, memory included; a softmax over those
keys has no key left, and :mod:`replay.zero_records` names it (:func:`carried_names`) as a
sequence that ended, not a record to filter.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path

from .domains import g
from .load import Step
from .recorded import n_args
from .rerun import Runner


def carried_keys(step: Step, mb: int) -> set[str]:
    """The bundle keys of micro-batch ``mb``'s root inputs that the model returned again with
    the same shape and dtype (a carried state); empty with fewer than two inputs, without a
    model, or when the forward re-run fails."""
    if step.model is None or mb >= len(step.micro_batches):
        return set()
    paths = step.micro_batches[mb].get("paths") or {}
    keys = [k for k in paths if isinstance(step.tensors.get(k), torch.Tensor)]
    if len(keys) < 2:
        return set()
    try:
        run = Runner(step).run(backward=False, instrument=False)
    except Exception:  # (no reading then: the outlier search keeps every input)
        return set()
    if mb >= len(run.outputs):
        return set()
    returned = {(tuple(t.shape), t.dtype) for t in run.outputs[mb][1:]}
    first = keys[0]  # (the batch itself: its prediction may share its shape)
    return {k for k in keys[1:] if k != first and
            (tuple(step.tensors[k].shape), step.tensors[k].dtype) in returned}


def carried_names(step: Step, mb: int) -> list[str]:
    """The readable names of micro-batch ``mb``'s carried states (see :func:`carried_keys`)."""
    entry = step.micro_batches[mb] if mb < len(step.micro_batches) else {}
    count = n_args(entry.get("inputs"))
    return [batch_path(entry["paths"][k], count) for k in sorted(carried_keys(step, mb))]


def carried_note(step: Step, origin: dict[str, Any], keys: set[str]) -> str | None:
    """The sentence an overflow's hint gains when a carried state of the origin's rows
    already reaches the square root of its type's largest value (one product from overflow);
    None otherwise."""
    mb = origin.get("micro_batch") or 0
    if mb >= len(step.micro_batches):  # (an update's event: no batch)
        return None
    entry = step.micro_batches[mb]
    rows = origin.get("samples") or []
    top: tuple[float, str, str] | None = None
    for key in sorted(keys):
        t = step.tensors[key]
        if not t.is_floating_point() or not t.numel():
            continue
        a = t.detach().abs().double()
        if rows and t.dim() and max(rows) < t.shape[0]:
            a = a[rows]
        big = float(torch.nan_to_num(a, posinf=0.0).max())
        limit = torch.finfo(t.dtype).max
        if big >= limit ** 0.5 and (top is None or big > top[0]):
            name = batch_path(entry["paths"][key], n_args(entry.get("inputs")))
            top = (big, name, f"{str(t.dtype).removeprefix('torch.')}'s largest {g(limit)}")
    if top is None:
        return None
    big, name, largest = top
    return (f"the recurrent state {name}, which the model returned in the step before and the "
            f"loop passed back in, already reached {g(big)} ({largest}): it "
            "grew over the earlier segments, and detaching it between segments does not bound "
            "it; keep the recurrence's state normalised or in log space (xLSTM's stabilizer "
            "m_t = max(log f_t + m_(t-1), log i_t), dividing both gates by exp(m_t)), or reset "
            "it; its rows are no bad records to drop")
