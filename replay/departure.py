"""Where a rewind window's re-run stops being the run that trained: a step before the event's
whose recorded values (the ring buffer's loss and gradient norm, checked finite when training
ran it) the re-run does not give back. The window re-runs the recorded batches from its copy
with the optimizer; what the loop changed between steps and the copy does not hold (weights
loaded with ``load_state_dict``: a federated round's global weights given to each client in
turn; a loss module's buffers set since: EWC's Fisher consolidated at a task boundary) makes
the re-run another run from there, whose steps say nothing about training's."""

from __future__ import annotations

import math
from typing import Any

from .load import Step

# a gradient norm further than this from the recorded one (relative) is another step's: the
# re-run's arithmetic is the run's, so only a different state moves it this far
_APART = 0.1
# a parameter's norm after an update further than this from training's (relative): the update
# started from other weights (a step's reordered sums move a norm by far less)
_WEIGHTS_APART = 1e-3

CHANGED = ("state the loop changed after the window's copy and that the copy does not hold "
           "makes the difference (weights loaded between steps with load_state_dict, as a "
           "federated round's global weights given to each client; a loss module's buffers "
           "set or replaced since, as EWC's Fisher consolidated at a task boundary; plain "
           "tensor attributes; values outside the batch)")


def _changed(step: Step) -> str:
    """:data:`CHANGED`, with the prune masks the bundle holds and the window's copy does not
    first (``torch.nn.utils.prune`` after attach: the re-run applies the event's masks)."""
    masks = [k.removeprefix("buffers/") for k in step.tensors
             if k.startswith("buffers/") and k.endswith("_mask")
             and f"weights/{k.removeprefix('buffers/').removesuffix('_mask')}_orig"
             in step.tensors and f"rewind/{k}" not in step.tensors]
    if not masks:
        return CHANGED
    return (f"the loop pruned the model (torch.nn.utils.prune) after the recorder attached "
            f"and the window's copy holds none of its masks ({', '.join(masks[:3])}"
            f"{', ...' if len(masks) > 3 else ''}): the re-run applies the masks the event's "
            "step found from the copy on, which is not the run where the pruning, or a "
            f"change of a mask, came after the copy; or {CHANGED}")


def departure(step: Step, per_step: list[dict[str, Any]], loop_clip,
              weight_norms: dict[int, dict[str, float]] | None = None
              ) -> tuple[int, str] | None:
    """The first step before the event's where the re-run is not the run, with the note that
    says so, or None. ``per_step``: the window's statistics, step by step; ``weight_norms``:
    each parameter's norm after the re-run's update of a step."""
    recorded, event = _recorded(step), step.event.get("step", 0)
    after = after_updates(step)
    if _moved(step):  # (SAM's: a re-run of the base optimizer alone, which a note says)
        after = {}
    norms = loop_clip is None and not (step.meta.get("rewind") or {}).get("grad_scaler") \
        and int((step.event.get("ranks") or {}).get("world_size") or 1) < 2
    for stats in per_step:
        s = stats.get("step")
        if s is None or s >= event or s not in recorded:
            continue
        (loss, r), g = recorded[s], _number(stats.get("grad_norm"))
        if math.isfinite(loss) and not math.isfinite(_number(stats.get("loss"))):
            # (the recorder checks every step's loss: a non-finite one would have raised)
            return s, (f"training ran step {s} with a finite loss ({loss:.4g}) and no event, "
                       f"so the window's re-run of it is not the step that ran: {_changed(step)}; "
                       f"the window says nothing about the steps from {s} on")
        # (norms the re-run takes as the recorder read them: no loop clip, scaler or peers)
        if norms and math.isfinite(g) and math.isfinite(r) \
                and abs(g - r) > _APART * max(abs(g), abs(r)):
            return s, (f"from step {s} the window's re-run is not the run: its gradient norm "
                       f"{g:.4g} where training's was {r:.4g}; {_changed(step)}; the window says "
                       f"nothing about the steps from {s} on")
        if norms and (moved := _weights_apart((weight_norms or {}).get(s), after.get(s))):
            name, got, was = moved
            return s, (f"from step {s} the window's re-run is not the run: its update of step "
                       f"{s} left {name} with norm {got:.6g} where training's left {was:.6g}, "
                       f"so the step started from other weights than training's (the update "
                       f"before re-ran as it ran): the loop wrote them between the updates (a "
                       f"load_state_dict of weights it computed; a clamp_, renormalisation or "
                       f"mask applied after optimizer.step(), which the re-run does not "
                       f"apply); {_changed(step)}; the window says nothing about the steps from {s} "
                       f"on")
    return None


def _moved(step: Step) -> bool:
    """Whether the loop moved the weights between a window step's forwards (SAM's ascent)."""
    return any(mb.get("weights_moved") for r in (step.meta.get("rewind") or {}).get("records")
               or [] for mb in r.get("micro_batches") or [])


def param_norms(model) -> dict[str, float]:
    """Each parameter's 2-norm (in float64; a complex one's of its moduli), by name: the
    weights an update left (not a placeholder's on the meta device, which holds no value)."""
    return {n: float(p.detach().abs().double().norm()) for n, p in model.named_parameters()
            if not p.is_meta}


def after_updates(step: Step) -> dict[int, dict[str, float]]:
    """Per step, each parameter's norm right after training's update of it: the ring's
    ``update_norms`` of the next step's row (the recorder takes them in ``step()``'s
    post-hook, before anything the loop writes next). Unsharded weights only."""
    t, meta = step.tensors, step.meta
    steps, norms = t.get("ring/steps"), t.get("ring/update_norms")
    names = meta.get("params") or []
    if steps is None or norms is None or meta.get("shards") or norms.shape[-1] != len(names):
        return {}
    return {int(s) - 1: {n: v for n, v in zip(names, row) if math.isfinite(v)}
            for s, row in zip(steps.tolist(), norms.double().tolist())}


def _weights_apart(got: dict[str, float] | None, was: dict[str, float] | None
                   ) -> tuple[str, float, float] | None:
    """The first parameter whose norm after the re-run's update is not training's."""
    for name, w in (was or {}).items():
        g = (got or {}).get(name)
        if g is not None and math.isfinite(g) and \
                not math.isclose(g, w, rel_tol=_WEIGHTS_APART, abs_tol=1e-6):
            return name, g, w
    return None


def tries_note(report: dict[str, Any]) -> str | None:
    """What a what-if re-run of a window that departed from the run proves (nothing), or
    None when the window did not depart."""
    s = (report.get("window") or {}).get("departed")
    if s is None:
        return None
    return (f"the window's re-run is not the run from step {s} (see the note), so neither is "
            "this try's: no evidence of a fix")


def _number(v) -> float:
    """A per-step statistic as a float (``"nan"``, ``"inf"`` as written; None: NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _recorded(step: Step) -> dict[int, tuple[float, float]]:
    """Each ring step's (loss, gradient norm) as training recorded them."""
    t = step.tensors
    steps, loss, grad = t.get("ring/steps"), t.get("ring/loss"), t.get("ring/grad_norm")
    if steps is None or loss is None or grad is None:
        return {}
    return {int(s): (float(a), float(b)) for s, a, b in zip(steps.tolist(), loss.tolist(),
                                                          grad.tolist())}
