"""A diverging run early in training whose optimizer has a warmup of its own, switched off.

Schedule-free optimizers (schedule_free's ``SGDScheduleFree``, ``AdamWScheduleFree``,
``RAdamScheduleFree``) keep no learning-rate schedule outside the optimizer: their only ramp
is the ``warmup_steps`` parameter group setting, 0 by default. With it left at 0 the first
updates take the full rate, which for ``SGDScheduleFree`` is typically 10 to 50 times a
scheduled SGD's, from weights whose gradients are largest; the weights jump at the first steps
and an op overflows a few steps in. The growth hint's "lower the learning rate" is one fix;
the one these optimizers are documented with is their warmup. Read from the rebuilt optimizer's
parameter groups, so any optimizer carrying a ``warmup_steps`` setting of 0 is told.
"""

from __future__ import annotations

# an event this early is within what a warmup would have ramped (schedule_free's examples
# warm up over a few hundred steps, about 5% of the run)
EARLY = 100


def no_warmup_advice(step) -> str | None:
    """The remedy for an early divergence under an optimizer whose ``warmup_steps`` is 0."""
    opt = getattr(step, "optimizer", None)
    event = (getattr(step, "meta", None) or {}).get("event") or {}
    at = event.get("step")
    if opt is None or not isinstance(at, int) or at >= EARLY:
        return None
    groups = [g for g in opt.param_groups if "warmup_steps" in g]
    if not groups or any(g["warmup_steps"] for g in groups):
        return None
    lr = groups[0].get("lr")
    rate = f" (lr={lr:.4g})" if isinstance(lr, (int, float)) else ""
    return (f"{type(opt).__name__} runs with warmup_steps=0, so its first updates took the "
            f"full learning rate{rate} from the start, with no schedule outside the optimizer "
            f"to ramp it, and the event came at step {at}: set warmup_steps (schedule_free's "
            "examples warm up over about 5% of the run) or lower the learning rate; clipping "
            "the gradients also bounds the first updates")
