"""An update at a learning rate of 0 whose own formula divided by 0.

Prodigy's and D-Adaptation's step size ``d = numerator / denominator`` divides sums that each
update adds lr-scaled terms to (Prodigy's ``s += d * lr * g``): at a warm-up's first step
(``LambdaLR(lambda s: s / warmup)`` at s = 0, ``LinearLR(start_factor=0)``) both are 0. Their
repositories return before the division while the denominator is 0; a copy without that check
(or one keeping the sums as tensors, to save the host reads) makes ``d`` NaN, and the update
with it. The op's own words (a count over the batch, a trust ratio's zero gradient) miss the
rate. So when every group's rate is 0, the update is re-run once more from the same state at a
positive rate (the groups' ``initial_lr``, the schedule's base, else the optimizer's default):
finite there, the rate of 0 is what made the divisor 0, and ``--try auto`` proposes that rate.
"""

from __future__ import annotations

import torch

from recorder.finite import finite

from .update_start import restore_start, saved_start

__all__ = ["finite_at_a_rate", "zero_rate_why"]


def _rate(v) -> float | None:
    """A group's ``lr`` as a number (a 0-d tensor's too); None for anything else."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _positive_rate(opt) -> float | None:
    """The rate the schedule starts from (``initial_lr``, which torch's schedulers keep in each
    group), else the optimizer's default ``lr``, when positive."""
    for v in [g.get("initial_lr") for g in opt.param_groups] + [opt.defaults.get("lr")]:
        if (r := _rate(v)) is not None and r > 0:
            return r
    return None


def finite_at_a_rate(model, opt) -> float | None:
    """The positive rate at which the update, re-run from the state it starts from, leaves
    every weight finite, where every group's ``lr`` is 0; None otherwise (a rate that is not 0,
    or an update that breaks at that rate too). ``model`` and ``opt`` are left as they were."""
    if not opt.param_groups or any(_rate(g.get("lr")) != 0 for g in opt.param_groups):
        return None
    rate = _positive_rate(opt)
    if rate is None:
        return None
    saved = saved_start(model, opt)
    try:
        for g in opt.param_groups:
            g["lr"] = g["lr"].fill_(rate) if isinstance(g["lr"], torch.Tensor) else rate
        opt.step()
        ok = all(finite(p) for p in model.parameters())
    except (RuntimeError, ValueError, TypeError, ArithmeticError):  # (unproven at that rate)
        ok = False
    finally:
        restore_start(model, opt, saved)
    return rate if ok else None


def zero_rate_why(domain: str | None, rate: float | None) -> str | None:
    """The hint's reason for an update whose division by 0 the rate of 0 made (``rate``: the
    one :func:`finite_at_a_rate` found); None for another domain, or no such rate."""
    what = (domain or "").partition(": ")[0]  # (the op's values; its advice is a batch's)
    if rate is None or not (" by 0" in what or "1/0" in what):
        return None
    return (f"{what}, with every param group's lr 0 in that update (a warm-up from 0: "
            "LambdaLR(lambda s: s / warmup) at s = 0, LinearLR(start_factor=0)); the update "
            f"re-run from the same state at lr={rate:g} is finite, so the divisor is a sum the "
            "update adds lr-scaled terms to, 0 at a rate of 0 (Prodigy's and D-Adaptation's "
            "d = numerator / denominator): skip the update while it is 0, as Prodigy does "
            "(if d_denom == 0: return), or start the warm-up above 0")
