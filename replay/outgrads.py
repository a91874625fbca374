"""Which recorded output gradients a re-run cannot take at their word: those of a micro-batch
whose recorded forward was non-finite. The gradient an output (the logits) received is partly
what the loop fed it and partly what the outputs computed from it (the loss a Hugging Face
model returns beside them) sent back through the model's own code; when that forward was
non-finite, so is what the loss sent, and the recorded gradient's non-finite entries say
nothing about the loop. A what-if whose changed forward is finite there must not inherit them
(``replay.rerun``: ``Runner.nonfinite_forwards``).
"""

from __future__ import annotations

from recorder.finite import pair_ok

from .load import Step


def nonfinite_forwards(step: Step, at: int) -> set[int]:
    """The micro-batches of step ``at`` whose root output the recorder saw non-finite (the
    ring buffer's root call, its min or max NaN or +-Inf)."""
    t, meta = step.tensors, step.meta
    fields = (meta.get("ring") or {}).get("call_fields") or []
    names = [m.get("name") for m in meta.get("modules") or []]
    if "ring/steps" not in t or "" not in names or not {"min", "max"} <= set(fields):
        return set()
    steps = t["ring/steps"].tolist()
    if at not in steps:
        return set()
    r = len(steps) - 1 - steps[::-1].index(at)  # (the last row of that step)
    root = names.index("")
    ends = t["ring/calls"][r, :, [fields.index("min"), fields.index("max")]].tolist()
    mods = t["ring/call_module"][r].tolist()
    mbs = t["ring/call_micro_batch"][r].tolist() if "ring/call_micro_batch" in t \
        else [0] * len(mods)
    return {int(mb) for (lo, hi), m, mb in zip(ends, mods, mbs) if m == root
            and not pair_ok(lo, hi)}
