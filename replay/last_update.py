"""A parameter the op took out of its domain (``log`` of a negative scale) while it was still
in it before the optimizer's last update: the update stepped it across the edge. TVAE's
per-column ``sigma`` enters the loss as ``log(sigma)`` and is kept in [0.01, 1] by a clamp
after each ``optimizer.step()``; without the clamp, Adam's steps of about ``lr`` chase a
sigma of a column reconstructed exactly towards 0 and one step crosses it. The weights before
that update are Adam's own arithmetic run backwards from the bundle's state:
``p + lr * m_hat / (sqrt(v_hat) + eps)``.
"""

from __future__ import annotations

import torch

ADAMS = {"torch.optim.adam.Adam", "torch.optim.adamw.AdamW"}
EDGE_AT_0 = {"aten.log", "aten.log2", "aten.log10", "aten.sqrt", "aten.rsqrt"}  # (x <= 0 out)

LAST_UPDATE = (
    "; the optimizer's last update ({cls}, lr {lr:g}, its update {t}) moved {name}[{index}] "
    "there from {before:.4g}, where the op was defined: a step of the optimizer crossed the "
    "domain's edge, which no eps at the op fixes; keep the parameter in its domain after "
    "each update (a clamp after optimizer.step(), as TVAE's sigma.data.clamp_(0.01, 1.0)) or "
    "by construction (its log learned)")


def before_update(step, name: str) -> torch.Tensor | None:
    """Parameter ``name`` before the recorded Adam or AdamW's last update (neither amsgrad
    nor maximize, no weight decay for Adam), from the bundle's weights and state; None
    otherwise."""
    info = step.meta.get("optimizer") or {}
    group = next((g for g in info.get("param_groups", []) if name in g.get("params", [])), None)
    w = step.tensors.get(f"weights/{name}")
    m, v, t = (step.tensors.get(f"optim/{name}/{k}") for k in ("exp_avg", "exp_avg_sq", "step"))
    if info.get("class") not in ADAMS or group is None or None in (w, m, v, t) \
            or group.get("amsgrad") or group.get("maximize") or not isinstance(
                group.get("lr"), float) or (info["class"].endswith(".Adam")
                                            and group.get("weight_decay")):
        return None
    n, (b1, b2) = float(t), group["betas"]
    if n < 1:
        return None
    lr, eps = group["lr"], group["eps"]
    w64, m64, v64 = w.double(), m.double(), v.double()
    before = w64 + lr * (m64 / (1 - b1 ** n)) / ((v64 / (1 - b2 ** n)).sqrt() + eps)
    if group.get("weight_decay"):  # (AdamW: decoupled, p * (1 - lr * wd) first)
        before = before / (1 - lr * group["weight_decay"])
    return before


def last_update_text(step, hit, below: float = 0.0) -> str:
    """``LAST_UPDATE`` for the entry of the parameter ``hit``'s op (one of ``EDGE_AT_0``)
    took as its smallest input, at or under ``below``, when the weights before the last
    update held it above ``below``; "" otherwise."""
    name, value = getattr(hit, "param", None), getattr(hit, "input_min", None)
    if hit is None or hit.op not in EDGE_AT_0 or name is None or value is None:
        return ""
    w = step.tensors.get(f"weights/{name}")
    before = before_update(step, name) if w is not None else None
    if before is None or not value <= below:
        return ""
    at = (w.double() == value).flatten().nonzero()
    if not len(at):
        return ""
    i = int(at[0, 0])
    was = float(before.flatten()[i])
    if not was > below:
        return ""
    info = step.meta["optimizer"]
    group = next(g for g in info["param_groups"] if name in g["params"])
    index = ", ".join(str(int(k)) for k in torch.unravel_index(torch.tensor(i), w.shape)) \
        if w.dim() > 1 else str(i)
    return LAST_UPDATE.format(cls=info["class"].rpartition(".")[2], lr=group["lr"],
                              t=int(float(step.tensors[f"optim/{name}/step"])), name=name,
                              index=index, before=was)
