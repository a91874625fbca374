"""A GradScaler event (its scale collapsed, or it skipped too many steps) whose scale is itself
inf or NaN: ``loss * scale`` is non-finite whatever the model computes, so every gradient is,
the scaler skips every step, and ``scale * backoff`` stays inf (NaN stays NaN): training has
stopped. A scale the ring holds non-finite from the first step the recorder saw came in so:
the scaler's state loaded from a checkpoint (``scaler.load_state_dict(ckpt["scaler"])``) that
holds it, a corrupt or hand-edited one, or ``init_scale`` set so. One the ring saw finite
before grew past float32's largest value: a run with no overflow to halve it doubles it every
``growth_interval`` steps. The re-run would scale the loss by that number and name the loss's
first op; there is nothing of the model's to find, so the report comes from the bundle.
"""

from __future__ import annotations

import math
from typing import Any

from recorder.capture import UnrebuildableLeaf, unflatten_tree

from .findings import finish, origin_fields
from .load import Step
from .recorded import scaler_state


def _number(v: Any) -> float | None:
    """A number of the bundle's JSON (a non-finite one is ``{"$float": "inf"}``), else None."""
    try:
        return float(unflatten_tree(v, {}))
    except (TypeError, ValueError, KeyError, UnrebuildableLeaf):
        return None


def _ring(step: Step) -> list[tuple[int, float, bool]]:
    t = step.tensors
    if "ring/steps" not in t or "ring/scale" not in t:
        return []
    skipped = t["ring/skipped"].tolist() if "ring/skipped" in t else [False] * len(t["ring/steps"])
    return sorted(zip(t["ring/steps"].tolist(), t["ring/scale"].tolist(), skipped))


def scale_report(report: dict[str, Any], step: Step) -> dict[str, Any] | None:
    """The report of a GradScaler event whose scale is not finite; None for any other."""
    if step.event.get("kind") != "scale":
        return None
    scale = _number(scaler_state(step).get("scale"))
    if scale is None or math.isfinite(scale):
        return None
    ring = _ring(step)
    finite = [s for s, v, _ in ring if math.isfinite(v)]
    ring_meta = step.meta.get("ring") or {}
    whole = ring_meta.get("stored", 0) < ring_meta.get("history", 0)  # (no step dropped)
    came_in = bool(ring) and not finite and whole
    skipped = sum(1 for _, _, k in ring if k)
    word = "NaN" if math.isnan(scale) else "inf"
    head = (f"the GradScaler's scale is {word}, so loss * scale is non-finite whatever the "
            f"model computes: every gradient is, the scaler skipped every update "
            f"({skipped} of the {len(ring)} steps recorded) and halving it leaves it "
            f"{word}: training has stopped, and no op of the model's is to blame")
    if came_in:
        hint = head + (
            f", and it was {word} at the first step the recorder saw (step {ring[0][0]}): it "
            "came in so, with the scaler's state loaded before (scaler.load_state_dict of a "
            "checkpoint whose 'scale' is not finite, saved by a run whose scale had already "
            "overflowed, or corrupt) or init_scale set so. Check the checkpoint's "
            "scaler state before loading it (math.isfinite(state['scale'])) and start the "
            "scaler afresh (a new GradScaler, without its state) when it is not")
    else:
        since = f" after step {finite[-1]}" if finite else ""
        hint = head + (
            f"; the scale was finite{since} and grew past float32's largest value (3.4e38): "
            "with no overflow to halve it, it doubles every growth_interval steps (a bfloat16 "
            "or float32 run scaled as if float16). Drop the GradScaler where the gradients "
            "are not float16, or restart it (a new GradScaler) from a checkpoint before")
    report["problems"].append(
        "the step is not re-run: with a non-finite loss scale every gradient is non-finite, "
        "whatever the model and the batch")
    origin = origin_fields(phase="backward", tensor="GradScaler scale", made=word)
    return finish(report, origin, "invalid" if word == "NaN" else "overflow",
                  reproduced=False, hint=hint)
