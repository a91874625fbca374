"""An optimizer event the bundle cannot re-run (it holds the weights after the update) whose
Adam-style moments disagree: NaN in one of ``exp_avg`` and ``exp_avg_sq`` where the other is
finite. The update folds one gradient into both, ``m = b1 m + (1 - b1) g`` and
``v = b2 v + (1 - b2) g^2``; a finite ``m`` (or ``v``) there says that gradient was finite, and
a finite gradient makes no NaN in the other from a finite value (an overflowing ``g^2`` makes
inf, not NaN). So the NaN moment held NaN before the update (an optimizer state loaded from a
corrupt checkpoint, written outside the optimizer), which no learning rate, eps or gradient
made. (The bundle's gradients are no evidence: they may be a later backward's, through the
NaN weights.)"""

from __future__ import annotations

import torch

from .load import Step

_PAIR = ("exp_avg", "exp_avg_sq")  # (Adam, AdamW, NAdam, RAdam: one gradient into both)


def nan_moment(step: Step, params: list[str]) -> tuple[str, str, str, int] | None:
    """(parameter, the NaN moment, the finite one, how many elements) of the first of
    ``params`` whose moments the bundle holds NaN in one and finite in the other; else None."""
    for name in params:
        a, b = (step.tensors.get(f"optim/{name}/{k}") for k in _PAIR)
        if a is None or b is None or a.shape != b.shape or not a.is_floating_point() \
                or not b.is_floating_point():
            continue
        for bad, good, (k_bad, k_good) in ((a, b, _PAIR), (b, a, _PAIR[::-1])):
            if (n := int((torch.isnan(bad) & torch.isfinite(good)).sum())):
                return name, k_bad, k_good, n
    return None


def nan_moment_why(step: Step, params: list[str]) -> str | None:
    """Why the update made NaN, said from the bundle's state after it; else None."""
    if (hit := nan_moment(step, params)) is None:
        return None
    name, bad, good, n = hit
    return (f"its state {bad} of {name} holds NaN at {n} element(s) where {good} is finite: "
            f"the update folds one gradient into both, and a gradient {good} shows finite "
            f"makes no NaN in {bad} from a finite value, so {bad} held NaN before this update "
            "(the recorder does not read optimizer state each step): loaded that way "
            "(optimizer.load_state_dict, fabric.load or accelerator.load_state of a corrupt "
            "checkpoint) or written outside the optimizer; resume from a checkpoint whose "
            "optimizer state is finite (torch.isfinite on each state tensor before loading "
            "it), or reset that parameter's state")
