"""An input event on a batch tensor the loop made require grad, at a step's first forward: most
often no record of data but a tensor the loop trains through the model, an image optimised as
its input (style transfer, feature visualisation, DeepDream's ascent
``img += lr * g / g.abs().mean()``). The data pipeline's hint alone sends the user to files that
were never read: the loop's own update of that tensor after an earlier step's backward made the
NaN/Inf. The ring buffer says when the model last took it finite and that step's loss: a loss
of exactly 0 (a channel the image does not activate, behind a ReLU) has a gradient of exactly
0, which a step normalised by its size divides by 0. Data the loop only differentiates by (a
PINN's collocation points) requires grad too: the hint keeps the data pipeline for it, and
names only it when the event is at the run's first step (step 0, nothing before it in the
ring): no update can have made it non-finite then (DeepXDE's anchors holding a NaN). Within
a step, ``replay.derived_input`` names the loop's step instead. A tensor the model's own
forward made require grad (``replay.self_grad_input``: an HNN's ``x.requires_grad_()``) is
data: no hint here."""

from __future__ import annotations

import math
from typing import Any

from .load import Step
from .recorded import input_origin, origin_key
from .self_grad_input import model_made_grad

TRAINED_INPUT = (
    "{tensor} required grad in training: no record of data, then, when it is a tensor the "
    "loop trains by its gradient (an image optimised as the model's input: style transfer, "
    "feature visualisation, DeepDream), whose update after an earlier step's backward made "
    "the NaN/Inf{before}{remedy}; to have its gradient checked and the op that made it "
    "named, hold the tensor in the model as an nn.Parameter that the optimizer given to "
    "FlightRecorder trains. Data the loop only differentiates by (a PINN's collocation "
    "points) is checked as any batch: the data pipeline for these samples")
# (a leaf no more: the input came with the autograd graph of a forward the loop ran before)
GRAPH_INPUT = (
    "{tensor} came with an autograd graph, no data and no tensor the loop trains: the output "
    "of a forward the loop ran before (another network's: a GAN generator's images fed to the "
    "discriminator, a teacher's or an encoder's output), which made it non-finite; record that "
    "network "
    "(FlightRecorder on it, with its own optimizer and a factory) to have the op that made it "
    "named")
# (no update of the loop's under the recorder came before the step that took it non-finite)
FIRST_DATA = (
    "{tensor} required grad in training and was non-finite already at the run's first step, "
    "before any update the loop made: data the loop differentiates "
    "by (a PINN's collocation points, made to require grad so that the loss can take "
    "derivatives of the output with respect to them), not a tensor an update broke: the data "
    "pipeline for these samples (the point sampler, the anchors or the file they came from) "
    "made them non-finite; drop or fix those points")
BEFORE = "; the model took it finite at step {s}"
LOSS = ", whose loss was {loss:.4g}"
ZERO_LOSS = (
    ", exactly 0: a loss of 0 (a unit the input does not activate, behind a ReLU) has a "
    "gradient of exactly 0, and a step divided by the gradient's size (g / g.abs().mean(), "
    "g / g.norm()) is 0/0 there: clamp the divisor from below "
    "(g / g.abs().mean().clamp_min(1e-8))")
EITHER = (
    ": a step divided by the gradient's size where the gradient was exactly 0 "
    "(g / g.abs().mean(), g / g.norm(): 0/0; clamp the divisor from below, "
    "g / g.abs().mean().clamp_min(1e-8)), or a non-finite gradient the update took (the sqrt "
    "of a total-variation or norm term at 0, over a flat region: sqrt(x + eps))")


def trained_input_hint(step: Step, origin: dict[str, Any] | None = None) -> str | None:
    """The hint of an input event on a batch tensor that required grad in training, at the
    step's first micro-batch (``origin``: the event's own when None); None otherwise."""
    if origin is None and step.event.get("phase") == "input":
        origin = input_origin(step)
    if origin is None or origin.get("micro_batch") or not step.micro_batches:
        return None
    key, _ = origin_key(step, origin)
    if not key or key not in step.micro_batches[0].get("grad_inputs", ()):
        return None
    if key in step.micro_batches[0].get("graph_inputs", ()):
        return GRAPH_INPUT.format(tensor=origin.get("tensor"))
    if model_made_grad(step, 0, key):  # (an HNN's x.requires_grad_() in forward: data)
        return None
    if _first_step(step):
        return FIRST_DATA.format(tensor=origin.get("tensor"))
    before, remedy = "", EITHER
    if (last := _last_finite_input(step)) is not None:
        s, loss = last
        before = BEFORE.format(s=s) + (LOSS.format(loss=loss) if math.isfinite(loss) else "")
        remedy = ZERO_LOSS if loss == 0 else EITHER
    return TRAINED_INPUT.format(tensor=origin.get("tensor"), before=before, remedy=remedy)


def _last_finite_input(step: Step) -> tuple[int, float] | None:
    """``(step, loss)`` of the ring buffer's last step before the event when its root calls
    all took finite inputs (its loss NaN when none was recorded); None when the ring does not
    say so."""
    t, meta = step.tensors, step.meta
    fields = (meta.get("ring") or {}).get("call_fields") or []
    names = [m.get("name") for m in meta.get("modules") or []]
    if not {"ring/steps", "ring/loss", "ring/calls"} <= set(t) or "" not in names \
            or "inputs_finite" not in fields:
        return None
    root, f = names.index(""), fields.index("inputs_finite")
    at = step.event.get("step")
    rows = [r for r, s in enumerate(t["ring/steps"].tolist()) if at is not None and s < at]
    for r in reversed(rows):
        mods = t["ring/call_module"][r].tolist()
        flags = [v for v, m in zip(t["ring/calls"][r, :, f].tolist(), mods) if m == root]
        loss = float(t["ring/loss"][r])
        if flags and all(v == 1 for v in flags):
            return int(t["ring/steps"][r]), loss
        return None  # (the step before the event's took it non-finite already)
    return None


def _first_step(step: Step) -> bool:
    """Is the event's step the run's first, step 0 (its ring holds no step before it): no
    update of the loop's came before it? (Attached mid-run, ``start_step``, updates did.)"""
    ring = step.tensors.get("ring/steps")
    at = step.event.get("step")
    if ring is None or at is None:
        return False
    return at == 0 and not any(s < at for s in ring.tolist())
