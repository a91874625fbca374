"""A parameter whose exp (or other op) overflowed while the optimizer had never updated it.

The advice for a parameter an op took as is and overflowed on (``replay.forward``'s
``PARAM_ADVICE``: bound it, or lower its learning rate) assumes updates drove it there. When
the recorded optimizer holds no state for it yet (Adam's moments and step are made by its
first update; Adagrad's step is still 0), no update has touched it: the value is the one the
model was built or loaded with, and the fix is that initialisation (a warm start that copied
scVI's dispersion ``theta`` into ``px_r``, which the model exponentiates), not the learning
rate.
"""

from __future__ import annotations

from typing import Any

# torch.optim classes whose per-parameter state exists once they have updated it
_LAZY = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Rprop", "ASGD",
         "SparseAdam", "Adafactor"}
_LR_ADVICE = " or lower its learning rate"
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
    initial value instead of its learning rate when no update has touched it."""
    if hint is None or hit is None or hit.param is None or cause != "overflow" \
            or not hint.endswith(_LR_ADVICE) or not never_updated(step, hit.param):
        return hint
    if not any(k.startswith("optim/") for k in step.tensors) \
            and not (step.meta.get("optimizer") or {}).get("state_scalars"):
        hint = hint.replace(_GENERIC_LR, "", 1)  # (no update has run at all)
    return (hint.removesuffix(_LR_ADVICE)
            + f"; the optimizer has not updated {hit.param} yet, so that is its initial value, "
              "as the model was built or loaded: fix that initialisation (a value copied where "
              "its log belongs, for a parameter the model exponentiates)")
