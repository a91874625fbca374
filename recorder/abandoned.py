"""Micro-batches the loop abandoned: the root forward raised and the loop handled the exception
and went on (an out-of-memory skip, `except RuntimeError: if "out of memory" ...: continue`; a
model refusing a malformed batch, `raise ValueError`, which the loop logs and skips). Such a
micro-batch has no output, no loss and no backward: the update never took it in. Its partial
statistics (the NaN features its own check refused, the NaN a layer made of them before the
raise) stay in the step's row, which the next ``step()`` checks: they are no event of that
step. An exception that leaves the ``with`` block is checked as such instead (``cut_short``)."""

from __future__ import annotations

import math
from typing import Any

from .slots import GRAD, NAN_ONLY, RELU_OF, STRICT


def abandoned(tape: Any) -> set[int]:
    """The micro-batches of ``tape`` whose root call never returned, in a step the loop went on
    with (closed by a later ``step()``, ``end_step()`` or the ``with`` block's normal exit)."""
    if tape.cut_short or tape.evaluation:
        return set()
    maybe = {i for i, m in enumerate(tape.micro_batches)
             if m.outputs is None and not m.out_grads}  # (no output kept, no backward)
    if maybe:  # (a root returning None did return: its post-hook recorded the call)
        maybe -= {c[1] for c in tape.calls if c[0] == 0}
    return maybe


def marked(tape: Any, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` (the bundle's ``micro_batches`` of ``tape``), each abandoned one marked so:
    the replay runs no forward of it."""
    for i in abandoned(tape):
        entries[i]["abandoned"] = True
    return entries


def clear_abandoned(tape: Any, layout: Any, values: list[float]) -> bool:
    """Write 0 over the statistics of ``tape``'s abandoned micro-batches in ``values`` (the
    host copy of the step's row, ``layout`` not yet decoded), so that the event finders do not
    see them; True when nothing the step's probe checks is left non-finite (no event)."""
    gone = abandoned(tape)
    if not gone or layout.raw is None:
        return False
    calls, loss, _, _, (shift, starts, ends), _, out_grads = layout.raw
    # (not a value a kept micro-batch made or took in: an input reuses its maker's slots)
    kept = _refs(tape, calls, loss, out_grads, set(range(len(tape.micro_batches))) - gone)
    for code, k in _refs(tape, calls, loss, out_grads, gone) - kept:
        if starts[code] + k < ends[code] and shift + starts[code] + k < len(values):
            values[shift + starts[code] + k] = 0.0
    checked = shift + ends[STRICT if layout.skipped else GRAD]
    nan_only = values[shift + starts[NAN_ONLY]: shift + ends[NAN_ONLY]]
    return all(math.isfinite(v) for v in values[:checked]) \
        and not any(math.isnan(v) for v in nan_only)


def _refs(tape: Any, calls, loss, out_grads, mbs: set[int]) -> set[tuple[int, int]]:
    """The slot refs of the statistics of micro-batches ``mbs``: their root inputs', their
    calls' outputs and inputs, their loss's and their output gradients'."""
    refs = {r for m in mbs for a, b, _ in tape.micro_batches[m].input_refs for r in (a, b)}
    for _, mb, _, outs, stats, ins in calls:
        if mb in mbs:
            refs.update(r for pair in outs for r in pair)
            refs.update(() if stats is None else (stats[0], stats[1]))
            refs.update(r for a, b, _ in ins for r in (a, b))
    refs.update(r for mb, lo, hi in loss if mb in mbs for r in (lo, hi))
    refs.update(ref for mb, _, ref in out_grads if mb in mbs)
    # (the ReLU of a slot, see recorder.slots.Slots.relu: that slot)
    return {(code - RELU_OF if code >= RELU_OF else code, k) for code, k in refs}
