"""A loss that took its infinities from inside an object of the model output.

A model may return objects that hold its tensors out of every walker's reach: a VAE's
``(px, qz)``, two ``torch.distributions`` objects whose parameters (logits, loc, scale) are
attributes. The recorder and the instrumented pass check a distribution's tensors, its
``logits`` for NaN only (their ±inf is a probability of 0 or 1), and no other object's, so a
±Inf the forward made there (logits divided by a temperature annealed to 0) is first an event
where the loss makes NaN of it: at the root's output, whose ±Inf led to it, or at the loss
when the recorder saw no tensor hold it; in the replay, a loss op that took infinities that no
loss op made and no tensor argument held. The forward of the root call, re-run under the op
finder, names the op that made them.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import finite

from .cause import classify
from .findings import finish, origin_fields
from .forward import find_op_in_call, module_source
from .load import Step
from .rerun import Runner


def came_inside_objects(hit, args, kwargs, held: str | None) -> bool:
    """The loss op ``hit`` took infinities that came in with the loss's arguments, though
    every tensor among them is finite (not the loss's own state, ``held``)."""
    return (hit is not None and not hit.inputs_finite and held is None
            and all(finite(t) for t in tensor_leaves((args, kwargs)))
            and any(not isinstance(a, (torch.Tensor, int, float, str, bool, type(None)))
                    for a in [*args, *kwargs.values()]))


def report_forward_behind_objects(report, step: Step, runner: Runner, mb: int, hit
                                  ) -> dict[str, Any] | None:
    """The forward origin of the infinities a loss op (``hit``) took from inside an object of
    the model output; None when the root call's re-run makes none from finite values."""
    finder = find_op_in_call(runner, "", 0, mb)
    made = finder.origin()
    if made is None:
        return None
    origin = origin_fields(
        phase="forward", module="", call=0, micro_batch=mb, inputs_finite=True,
        made=made.made, samples=made.rows or [], op=made.op,
        source=made.source or module_source(step, ""), chain=finder.chain(),
        input_range=[made.input_min, made.input_max],
        dtype=str(made.evidence.dtype).removeprefix("torch.") if made.evidence else None)
    cause = classify(runner, "forward", until=("", 0, mb), hit=made)
    report["problems"].append(
        f"the loss's {hit.op}{f' ({hit.source})' if hit.source else ''} made {hit.made} of "
        f"the {made.made} that {made.op} made in the forward, carried into the loss inside an "
        "object of the model output (a torch.distributions object, where a logit's ±inf is a "
        "probability of 0 or 1): the origin is that op")
    # (the recorder's event: that loss, or the root's output whose ±inf led to it)
    phase = step.event.get("phase")
    reproduced = phase == "loss" or (phase == "forward" and not step.event.get("module"))
    return finish(report, origin, cause.name, reproduced=reproduced, hint=cause.hint)
