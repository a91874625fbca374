"""A distribution refusing one of the model's own parameters, which the optimizer stepped
outside the constraint (a Dirichlet-VAE's learned prior concentration ``Dirichlet(self.alpha)``
that Adam moved below 0): the parameter and its refused entries, not the whole vector.

A constraint over a vector (``independent(positive, 1)``: a concentration) checks each vector
as a whole, so every entry of a vector holding one negative value reads as refused ("4 values
refused, from -0.31 to 2.06"); the base constraint's own check says which entries it refuses.
The generic advice (a scale through softplus) is right, but names no parameter: the value is
not made by any op of the step, it is the parameter as the last update left it.
"""

from __future__ import annotations

import torch
from torch.distributions import constraints


def entry_valid(frame_locals: dict, value: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``valid`` (per vector, expanded to ``value``'s shape) per entry where the check's
    constraint (``constraint`` in ``_validate_args``, ``support`` in ``_validate_sample``)
    reinterprets an elementwise one over the last dims."""
    cons = frame_locals.get("constraint", frame_locals.get("support"))
    if not isinstance(cons, constraints.independent):
        return valid
    try:
        with torch.no_grad():
            entry = cons.base_constraint.check(value.detach())
    except Exception:  # a base constraint that cannot check entries alone
        return valid
    if not isinstance(entry, torch.Tensor) or entry.shape != value.shape or bool(entry.all()):
        return valid
    return entry


def refused_param(model: torch.nn.Module, value) -> str | None:
    """The name of the model's parameter that the refused ``value`` is (itself or a view of
    all of it), else None."""
    if not isinstance(value, torch.Tensor):
        return None
    for name, p in model.named_parameters():
        if p.data_ptr() == value.data_ptr() and p.numel() == value.numel():
            return name
    return None


def param_hint(hint: str, name: str, refused: str, value: torch.Tensor,
               valid: torch.Tensor) -> str:
    """The hint for a refused parameter ``name`` (``hint``: the generic one, kept after)."""
    bad = (~valid).reshape(-1).nonzero().flatten().tolist()
    shown = ", ".join(f"{name}[{i}] = {float(value.reshape(-1)[i]):.3g}" for i in bad[:4])
    return (f"{refused}: the value is the model's parameter '{name}' itself, as the last "
            f"update left it ({shown}{', ...' if len(bad) > 4 else ''}): nothing of this step "
            "made it, the optimizer stepped it freely across the constraint. Parametrize it "
            "so that it satisfies the constraint by construction (a raw parameter through "
            "softplus or exp: alpha = F.softplus(raw_alpha) + 1e-3, or learn log_alpha and "
            "use log_alpha.exp()), or project it back after each step "
            f"(with torch.no_grad(): {name}.clamp_(min=1e-3)); a lower learning rate only "
            "delays it")
