"""Recorded gradients NaN in every element that the re-run's backward leaves finite: the loop's
code between ``backward()`` and ``optimizer.step()`` spread the origin's NaN into them.

``clip_grad_norm_`` (Poutyne's ``ClipNorm`` callback, skorch's ``GradientNormClipping``, a
Trainer's ``max_grad_norm``) multiplies every gradient by ``max_norm / total_norm``; a NaN in
one entry makes the total norm, so the factor, NaN, and every parameter's gradient is NaN in
every element when the step closes. The event lists them all; the re-run, which applies no
clip, finds the one the backward made (the origin). Not said when the gradient entering the
model's output was non-finite itself (a loss outside the model spreads its NaN that way). Without a word the other parameters of
the event are unexplained, and a user may hunt for a second bug in them.
"""

from __future__ import annotations

from typing import Any

import torch

from .load import Step, output_grads

SHOWN = 6  # parameters named in the note


def spread_grads_note(report: dict[str, Any], step: Step) -> None:
    """Append the note to ``report["problems"]`` when a reproduced backward origin's
    parameters are a part of the event's, and every other one's recorded gradient is NaN in
    every element."""
    o = report.get("origin") or {}
    found = set(o.get("params") or ())
    if o.get("phase") != "backward" or not report.get("reproduced") or not found \
            or _entered_non_finite(step):
        return
    others = [p for p in step.event.get("params") or () if p not in found]
    grads = [step.tensors.get(f"grads/{p}") for p in others]
    if not others or not all(isinstance(g, torch.Tensor) and g.is_floating_point()
                             and g.numel() and bool(torch.isnan(g).all()) for g in grads):
        return
    shown = ", ".join(others[:SHOWN]) + (f" (+{len(others) - SHOWN})" if len(others) > SHOWN
                                         else "")
    report["problems"].append(
        f"the recorded gradients of {shown} are NaN in every element, while the re-run's "
        f"backward leaves them finite: the loop's code between backward() and "
        f"optimizer.step() spread {o.get('param') or sorted(found)[0]}'s NaN into them, "
        "as a clip_grad_norm_ does, whose total norm, so its factor max_norm / total_norm, is "
        "NaN (Poutyne's ClipNorm, skorch's GradientNormClipping, a Trainer's max_grad_norm); "
        "the origin above is the one bug to fix")


def _entered_non_finite(step: Step) -> bool:
    """A recorded gradient entering the model's output is non-finite in some micro-batch (a
    loss outside the model: its NaN reached every parameter through the model's backward,
    no clip needed)."""
    return any(not bool(torch.isfinite(g).all())
               for i in range(len(step.micro_batches)) for g in output_grads(step, i).values()
               if isinstance(g, torch.Tensor) and g.is_floating_point())
