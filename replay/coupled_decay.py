"""SGD's weight decay coupled into the gradient, too large for its learning rate.

``torch.optim.SGD(weight_decay=wd)`` adds ``wd * p`` to each gradient inside ``step()`` (after
any clipping of the loop's), then runs it through the momentum buffer: on the decay's term alone
the update is heavy-ball descent on ``wd / 2 * |p|^2``, which diverges once ``lr * wd`` passes
``2 * (1 + momentum)`` (2 without momentum): every update multiplies the weights by a factor of
magnitude above 1 (a prior precision given as ``weight_decay`` without dividing it by the
data set's size). Unlike a decoupled decay's ``p.mul_(1 - lr * wd)`` (``replay.weight_scale``)
no single op shows that factor, so it is read from the hyper-parameters: the spectral radius of
the linear map the decay's term makes of ``(p, momentum buffer)``.

>>> coupled_growth({"lr": 0.05, "weight_decay": 100.0, "momentum": 0.9})  # doctest: +SKIP
2.775...
"""

from __future__ import annotations

import math
from typing import Any

import torch


def coupled_growth(group: dict[str, Any]) -> float | None:
    """How much SGD's decay term alone multiplies the weights per update (the spectral radius
    of its iteration), None when the group has no decay or the numbers are not finite."""
    try:
        lr, wd = float(group.get("lr") or 0.0), float(group.get("weight_decay") or 0.0)
        mom = float(group.get("momentum") or 0.0)
        damp = float(group.get("dampening") or 0.0)
    except (TypeError, ValueError):
        return None
    if not (lr > 0 and wd > 0) or not all(map(math.isfinite, (lr, wd, mom, damp))):
        return None
    b = wd * (1.0 - damp)  # (what the buffer takes of the decay term)
    sign = 1.0 if group.get("maximize") else -1.0
    if not mom:
        return abs(1.0 + sign * lr * wd)
    # state (p, v): v' = mom v + h p; p' = p + sign lr (v' or, nesterov, h p + mom v')
    if group.get("nesterov"):
        m = [[1.0 + sign * lr * (wd + mom * b), sign * lr * mom * mom], [b, mom]]
    else:
        m = [[1.0 + sign * lr * b, sign * lr * mom], [b, mom]]
    return float(torch.linalg.eigvals(torch.tensor(m, dtype=torch.float64)).abs().max())


def coupled_decay(step) -> dict[str, Any] | None:
    """The first group, at the first window step (else the bundle's optimizer), whose coupled
    SGD weight decay grows the weights: ``{"step", "group", "lr", "weight_decay", "momentum",
    "growth"}``; None for other optimizers and decays that shrink them."""
    if not isinstance(step.optimizer, torch.optim.SGD):
        return None
    per_step = [(r.get("step"), r.get("hyper") or []) for r in _records(step)]
    groups = (step.meta.get("optimizer") or {}).get("param_groups") or []
    for at, hyper in per_step + [(step.event.get("step"), groups)]:
        for i, g in enumerate(hyper):
            growth = coupled_growth(g)
            if growth is not None and growth > 1.0 + 1e-9:
                return {"step": at, "group": i, "lr": float(g["lr"]),
                        "weight_decay": float(g["weight_decay"]),
                        "momentum": float(g.get("momentum") or 0.0), "growth": growth}
    return None


def _records(step) -> list[dict[str, Any]]:
    return list((step.meta.get("rewind") or {}).get("records") or [])


def coupled_text(found: dict[str, Any], windowed: bool) -> str:
    """The growth hint's remedy for :func:`coupled_decay`."""
    bound = 2.0 * (1.0 + found["momentum"])
    mom = f", momentum {found['momentum']:.3g}" if found["momentum"] else ""
    group = f" (parameter group {found['group']})" if found["group"] else ""
    tries = ("--try wd=0 tests it" if windowed else
             "record with FlightRecorder(..., rewind=N) so that --try wd=0 re-runs the steps "
             "that grew")
    return (f"SGD's weight_decay={found['weight_decay']:.3g}{group} at lr={found['lr']:.3g}"
            f"{mom} makes lr * weight_decay {found['lr'] * found['weight_decay']:.3g}, above "
            f"the {bound:.3g} where the decay term it adds to every gradient diverges on its "
            f"own: it multiplies the weights by {found['growth']:.3g}x per update whatever the "
            "gradients were, and is added inside step(), after any clipping, so clipping does "
            "not stop it; lower weight_decay (a prior's precision divided by the data set's "
            f"size) or the learning rate ({tries})")
