"""A parameter whose exp (or other op) overflowed while the optimizer had never updated it.

The advice for a parameter an op took as is and overflowed on (``replay.forward``'s
``PARAM_ADVICE``: bound it, or lower its learning rate) assumes updates drove it there. When
the recorded optimizer holds no state for it yet (Adam's moments and step are made by its
first update; Adagrad's step is still 0), no update has touched it: the value is the one the
model was built or loaded with, and the fix is that initialisation (a warm start that copied
scVI's dispersion ``theta`` into ``px_r``, which the model exponentiates), not the learning
rate. So is a row of an embedding the optimizer updates but no batch has looked up yet (a
per-particle defocus table loaded from a STAR file, one row in Å where its log belongs): its
optimizer state is still exactly 0 there.
"""

from __future__ import annotations

from typing import Any

import torch

# torch.optim classes whose per-parameter state exists once they have updated it
_LAZY = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Rprop", "ASGD",
         "SparseAdam", "Adafactor"}
_LR_ADVICE = " or lower its learning rate"
_EXP_OPS = ("aten.exp", "aten.exp2", "aten.expm1")  # ops exponentiating their input
_GENERIC_LR = ", or lower the learning rate"  # (the op's own advice, for every weight)


def never_updated(step, name: str) -> bool:
    """The bundle's optimizer trains ``name`` and has not updated it yet."""
    info: dict[str, Any] = step.meta.get("optimizer") or {}
    path = str(info.get("class", ""))
    if not any(name in g.get("params", ()) for g in info.get("param_groups", ())):
        return False
    keys = [k for k in step.tensors if k.startswith(f"optim/{name}/")]
    if (info.get("state_scalars") or {}).get(name):
        return False
    if f"optim/{name}/step" in keys:
        return float(step.tensors[f"optim/{name}/step"]) == 0
    return not keys and path.startswith("torch.optim.") and path.rpartition(".")[2] in _LAZY


def initial_value_hint(step, hint: str | None, cause: str, hit) -> str | None:
    """``hint`` whose advice for the overflowing parameter ``hit.param`` speaks of its
    initial value instead of its learning rate when no update has touched it, or none has
    touched the rows holding the op's largest input (:func:`untouched_rows`)."""
    if hint is None or hit is None or hit.param is None or cause != "overflow" \
            or not hint.endswith(_LR_ADVICE):
        return hint
    if not never_updated(step, hit.param):
        rows = untouched_rows(step, hit.param, hit.input_max)
        return hint if not rows else (
            hint.replace(_GENERIC_LR, "", 1).removesuffix(_LR_ADVICE)
            + f"; row(s) {', '.join(map(str, rows[:8]))} of {hit.param}, which hold the "
            f"largest input {hit.input_max:.4g}, have never had a gradient (the "
            "optimizer's state is exactly 0 there: no batch looked them up before), so they "
            "still hold the values the model was built or loaded with: fix that "
            "initialisation (a value copied where its log belongs), not the learning rate")
    if not any(k.startswith("optim/") for k in step.tensors) \
            and not (step.meta.get("optimizer") or {}).get("state_scalars"):
        hint = hint.replace(_GENERIC_LR, "", 1)  # (no update has run at all)
    # (a log-scale parameter set to its value, CLIP's logit_scale of 100 for log 100; not
    # a weight matrix a float16 cast or product overflowed: an MoE router's)
    why = " (a value copied where its log belongs, for a parameter the model exponentiates)" \
        if hit.op in _EXP_OPS else ""
    return (hint.removesuffix(_LR_ADVICE)
            + f"; the optimizer has not updated {hit.param} yet, so that is its initial value, "
              f"as the model was built or loaded: fix that initialisation{why}")


def untouched_rows(step, name: str, value: float | None) -> list[int]:
    """The rows of the parameter ``name`` holding ``value`` whose optimizer state is exactly 0
    in every state tensor of the parameter's shape, when others' is not (rows no gradient
    has reached: an embedding's ids no batch held yet); else []."""
    w = step.tensors.get(f"weights/{name}")
    if w is None or value is None or w.dim() < 1 or len(w) < 2:
        return []
    states = [t.reshape(len(w), -1) for k, t in step.tensors.items()
              if k.startswith(f"optim/{name}/") and t.shape == w.shape]
    held = (w == value).reshape(len(w), -1).any(1)
    zero = [(t == 0).all(1) for t in states]
    if not states or not bool(held.any()) or all(bool(z.all()) for z in zero):
        return []
    untouched = held & torch.stack(zero).all(0)
    return untouched.nonzero().flatten().tolist() if bool(untouched.eq(held).all()) else []
