"""Loop-written gradients NaN in every element of every parameter: one NaN scalar the loop's
code multiplied into all of them, not a bug of any one entry.

An evolution strategy's estimate ``sum_i w_i eps_i / (n sigma)`` gives each entry the same
shaped fitness ``w``: ``(f - f.mean()) / f.std()`` is 0/0 in all of them when every
perturbation scored alike (a flat or saturated reward), and one perturbation's non-finite
return makes the mean, so every ``w_i``, NaN. A global normalisation of the gradient by a norm
of 0 does the same, and so does ``clip_grad_norm_`` after a NaN in any one entry (its
coefficient ``max_norm / total_norm`` is NaN). The bundle's gradients show the pattern; the
code is the loop's.
"""

from __future__ import annotations

import torch

from .load import Step


def every_entry_nan(step: Step, params: list[str]) -> bool:
    """Every recorded gradient (of ``params``, the non-finite ones, covering every gradient
    the bundle holds) is NaN in every element."""
    grads = {k.removeprefix("grads/"): g for k, g in step.tensors.items()
             if k.startswith("grads/") and g.is_floating_point() and g.numel()}
    if not params or set(grads) - set(params) or len(grads) < 2 \
            or step.meta.get("state") == "after_update":
        return False  # (a single parameter's NaN says nothing about a shared factor)
    return all(bool(torch.isnan(g).all()) for g in grads.values())


def shared_factor_text(step: Step, params: list[str]) -> str:
    """``; every element of every gradient was NaN: ...`` or ``""``."""
    if not every_entry_nan(step, params):
        return ""
    return ("; every element of every parameter's gradient was NaN, so one NaN scalar the "
            "loop's code multiplied into all of them made it, not any one entry: a normaliser "
            "of 0 (a std or norm over values that were all equal: an evolution strategy's "
            "fitness shaping (f - f.mean()) / f.std() when every perturbation scored the same, "
            "a flat or saturated reward; add an eps, (f.std() + 1e-8), or shape by centred "
            "ranks) or a NaN/Inf in a sum every entry takes (one episode's non-finite return "
            "or reward: check the fitness for non-finite values before shaping it); a "
            "clip_grad_norm_ in between spreads a NaN of any one entry this way too (its "
            "total norm, so its coefficient, is NaN): check the gradients before the clip")
