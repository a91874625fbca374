"""Whole columns of a first layer's weight that an update made non-finite where the model
input feeding that layer is 0 in every sample.

A feature that never varies from 0 (a hyperspectral scene's water-absorption bands, which no
light reaches; a gene no cell of the dataset expresses; a sensor channel that is dead) gives
the weights reading it, a ``Linear``'s column, a gradient of exactly 0 at every step, and an
update that divides by its accumulated square (Adam with ``eps=0``: m / sqrt(v) = 0/0) makes
exactly those columns NaN. The optimizer's hint says what its eps does; this names the
columns and the input that left them without a gradient, so the user can drop the features
where the data is made.
"""

from __future__ import annotations

import torch

from .empty_counts import root_inputs
from .load import Step

SHOWN = 8  # columns named in the hint


def zero_input_columns_text(step: Step, name: str, w: torch.Tensor) -> str:
    """``; the NaN fill whole column(s) ...`` when the non-finite entries of weight ``w``
    (``name``, 2-D, after the update) are whole columns, not all of them, and a 2-D model input
    of as many features is 0 in every sample of every micro-batch in exactly those columns
    (nonzero somewhere in some other); else ``""``."""
    if w.dim() != 2 or not w.is_floating_point() or not w.numel():
        return ""
    bad = ~torch.isfinite(w.detach())
    whole = bad.all(0)
    if not bool(whole.any()) or bool(whole.all()) or bool((bad & ~whole).any()):
        return ""
    cols = whole.nonzero().flatten().tolist()
    for input_name, zero in _zero_features(step, w.shape[1]).items():
        if bool(zero[cols].all()) and not bool(zero.all()):
            shown = ", ".join(map(str, cols[:SHOWN])) + (
                f" (+{len(cols) - SHOWN})" if len(cols) > SHOWN else "")
            return (f"; the non-finite entries are whole column(s) {shown} of {name}, the "
                    f"weights of feature(s) {shown} of {input_name}, which hold 0 in every "
                    "sample of the batch: a feature that never varies from 0 (a band no "
                    "light reaches, a gene no cell expresses, a dead sensor channel) gives "
                    "its weights a gradient of exactly 0 at every step; drop such features "
                    "where the data is made")
    return ""


def _zero_features(step: Step, width: int) -> dict[str, torch.Tensor]:
    """Readable name -> per feature, whether the 2-D ``(samples, width)`` model input of that
    name is 0 in every sample of every micro-batch that has it."""
    found: dict[str, torch.Tensor] = {}
    for mb in range(len(step.micro_batches)):
        for name, t, d in root_inputs(step, mb):
            if t.dim() == 2 and d == 0 and t.shape[1] == width:
                zero = (t.detach() == 0).all(0).cpu()
                found[name] = found[name] & zero if name in found else zero
    return found
