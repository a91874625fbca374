"""Gradients whose float32 norm overflowed at a step whose loss and weights did not move: the
loop added to them after backward.

DP-SGD (Opacus's DPOptimizer) clips each sample's gradient to ``max_grad_norm`` and then adds
Gaussian noise of std ``noise_multiplier * max_grad_norm`` to their sum: a noise multiplier of
1e30 (a typo, or one computed from a target epsilon that no noise reaches) hands the optimizer
gradients of 1e28 from a loss of 0.69, and one update puts the weights beyond the next
forward's range. Backward cannot make such gradients from a loss and weights that stayed where
they were, and clipping them (which runs before the noise) bounds nothing: the growth hint
names what the loop adds to the gradients instead of the learning rate.

Not when the forward of that step could make them: a weight's gradient is an activation times
the gradient the loss sends back, so activations of 1e17 (a column of nanosecond timestamps
fed unscaled to a ``Linear``) under a squared error of 1e31 give gradients far beyond 1.8e19
from backward alone, with no jump to see at the first step recorded.
"""

from __future__ import annotations

import math
import statistics

from .precursors import JUMP, history, overflowed_norms

# (a float32 norm overflows at 1.8e19; over a million entries, each may be 1e3 times smaller)
_REACHED = 1.8e19 / 1e3

NOISED = (
    "the gradients' norm overflowed float32 at step {s} while the loss there ({loss:.4g}) and "
    "the weights it began with had not jumped: backward makes no such gradients, the loop "
    "added them after it (DP-SGD's Gaussian noise, std noise_multiplier * max_grad_norm, added "
    "after the per-sample clip, so clipping bounds nothing: check the noise multiplier Opacus's "
    "make_private was given or make_private_with_epsilon computed; a gradient scaled or "
    "written by hand): keep what is added to them on the gradients' scale")


def noised_grads_advice(step) -> str | None:
    """The advice when the first overflowed gradient norm before the event
    (:func:`replay.precursors.overflowed_norms`) came at a step whose loss was finite and no
    jump from the steps before, as the weights' norm that step began with; None otherwise."""
    hist = history(step.meta, step.tensors)
    jump = next((p for p in overflowed_norms(hist) if p["kind"] == "grad_norm_jump"), None)
    if jump is None:
        return None
    i = hist["steps"].index(jump["step"])
    if backward_reaches(hist, i):
        return None
    for col in ("loss", "weight_norm"):
        values = hist.get(col) or []
        if i >= len(values) or not _steady(values[: i + 1]):
            return None
    return NOISED.format(s=jump["step"], loss=hist["loss"][i])


def backward_reaches(hist: dict, i: int) -> bool:
    """Whether the forward of the ``i``-th step of the history could make gradients whose
    float32 norm overflows: its layers' largest absmax times the derivative a loss of that
    size sends back (at most about its square root for a squared error, 1 for a
    cross-entropy) reaches ``_REACHED``."""
    rows, losses = hist.get("absmax") or [], hist.get("loss") or []
    row = rows[i] if i < len(rows) else []
    big = max((abs(v) for v in row if v is not None and math.isfinite(v)), default=0.0)
    loss = losses[i] if i < len(losses) else None
    scale = math.sqrt(abs(loss)) if loss is not None and math.isfinite(loss) else 1.0
    return big * max(1.0, scale) >= _REACHED


def _steady(values: list) -> bool:
    """The last of ``values`` finite and less than ``JUMP`` times the median of the finite ones
    before it (any, when there are none)."""
    last, before = values[-1], [abs(v) for v in values[:-1] if v is not None and math.isfinite(v)]
    if last is None or not math.isfinite(last):
        return False
    return not before or abs(last) < JUMP * statistics.median(before)
