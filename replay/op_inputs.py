"""An op's inputs as the op finder reads them: their ends in one host read, and their values
where the op's output went non-finite."""

from __future__ import annotations

import torch

from recorder.finite import ends, pair_ok


def input_ends(ins: list[torch.Tensor]):
    """(each input's (min, max), the inputs' min and max when none is NaN, no NaN or Inf in
    any, no NaN in any): one reduction and one read for all inputs, as min and max say NaN
    (propagated) and Inf too."""
    if not ins:
        return [], None, None, True, True
    with torch.no_grad():
        pairs = torch.stack([ends(t) for t in ins]).tolist()
    in_finite = all(pair_ok(a, b) for a, b in pairs)
    in_nan_free = all(pair_ok(a, b, allow_inf=True) for a, b in pairs)
    if not in_nan_free:
        return pairs, None, None, in_finite, in_nan_free
    return pairs, min(a for a, _ in pairs), max(b for _, b in pairs), in_finite, in_nan_free


def values_at(t: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t``'s float64 values where ``bad`` is set, when ``t`` broadcasts to its shape; else
    every value of ``t``."""
    t = t.detach()
    try:
        return torch.broadcast_to(t, bad.shape)[bad].double(), True
    except RuntimeError:
        pass
    if bad.dim() == t.dim() + 1 and bad.shape[-1] == 2:  # a real input of a complex op, whose
        try:  # output's real view (see dispatch.real_view) has (re, im) last
            return torch.broadcast_to(t.unsqueeze(-1), bad.shape)[bad].double(), True
        except RuntimeError:
            pass
    return t.flatten().double(), False
