"""An overflow inside a ReLU recurrence (``nn.RNN(nonlinearity="relu")``, ``nn.RNNCell``).

Its hidden state has no bound: each time step multiplies it by ``weight_hh``, so with a
spectral radius above 1 (an IRNN's identity init scaled up, a gain on an orthogonal init) the
state grows geometrically and a long enough sequence overflows any type. The op's own advice (compute
in float64) only postpones that, and the generic one of a diverging loop (Newton-Schulz, fixed
points, a Hopfield descent) names no such weight; this hint replaces them, with the radius
measured on the step's weights and the fixes of the recurrence; not where the run had been
diverging before the step (a learning rate that blew the weights up: :mod:`replay.diverging_hint`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .diverging_hint import growth_jump
from .load import Step


def relu_recurrence_hint(report: dict[str, Any], step: Step) -> None:
    """Say so where a forward ``overflow``'s module is a ReLU RNN or RNN cell."""
    o = report["origin"]
    name = o.get("module")
    if report.get("cause") != "overflow" or o.get("phase") != "forward" or name is None \
            or step.model is None or not report.get("hint") or growth_jump(report):
        # (weights a diverging run blew up: the diverging run's hint says so)
        return
    module = dict(step.model.named_modules()).get(name)
    if not isinstance(module, (nn.RNN, nn.RNNCell)) or module.nonlinearity != "relu":
        return
    radius = max(_radius(p) for key, p in module.named_parameters() if key.startswith("weight_hh"))
    if radius > 1:
        why = (f"whose spectral radius is {radius:.3g}, above 1: the state grows as "
               f"{radius:.3g}^t, so a long enough sequence overflows whatever the type")
    else:
        why = (f"whose spectral radius is {radius:.3g}, at most 1: the growth is the inputs "
               "the state sums over a long sequence")
    # (the op's own advice, float64 or a rescaled input, only postpones a geometric growth)
    report["hint"] = (
        f"{o.get('op')} overflowed {o.get('dtype') or 'its type'} inside {name or 'the model'}, "
        "a ReLU recurrence (nonlinearity='relu'): its hidden state has no bound, and each time "
        f"step multiplies it by weight_hh, {why}. Keep weight_hh's spectral radius at most 1 (an "
        "identity init unscaled, as the IRNN's; an orthogonal one; renormalise it after "
        "updates), normalise the inputs, use nonlinearity='tanh' or an LSTM or GRU, or cut "
        "long sequences into shorter windows")


def _radius(w: torch.Tensor) -> float:
    """The largest magnitude of the square recurrent matrix ``w``'s eigenvalues."""
    w = w.detach().to("cpu", torch.float64)
    return float(torch.linalg.eigvals(w).abs().max()) if w.dim() == 2 and w.shape[0] == w.shape[1] \
        else float(torch.linalg.matrix_norm(w, 2))
