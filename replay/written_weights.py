"""Trained weights the recorded step's own code made non-finite before any update, given back
the values the factory builds for their non-finite entries.

A forward that writes its weights in place (TransE-PyTorch renormalises its entities with
``weight.data[:-1].div_(norm)`` at each call) leaves NaN in the bundle where it divided a zero
row (a padding entity) by its norm of 0: the recorder sees the step end with those weights
non-finite (``written_in_step``), and writes them as they are. Re-run from NaN, the write has a
NaN input and the op that made it is not found. Those entries' pre-step values are lost; the
factory's are the same while no update moved them (a padding row, whose gradient is 0), which
the re-run checks by making the NaN again from them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["refill_written"]


def refill_written(step, model: nn.Module, names: list[str]) -> str | None:
    """Replace the non-finite entries of ``model``'s parameters ``names`` (the recorder's
    ``written_in_step``) by the factory's finite values for them (a new tensor: the bundle's
    stays as read); the note for the report, or None when there is none to refill."""
    params = dict(model.named_parameters())
    bad = {n: ~torch.isfinite(params[n].detach()) for n in names
           if n in params and params[n].is_floating_point()
           and not torch.isfinite(params[n].detach()).all()}
    if not bad or step.rebuild is None:
        return None
    try:
        fresh = dict(step.rebuild().named_parameters())
    except Exception:  # (a factory that builds only once: the re-run starts from NaN, as before)
        return None
    done = []
    with torch.no_grad():
        for n, mask in bad.items():
            f, p = fresh.get(n), params[n]
            if f is None or f.shape != p.shape:
                continue
            f = f.detach().to(p.device, p.dtype)
            fill = mask & torch.isfinite(f)
            if fill.any():
                p.data = torch.where(fill, f, p.detach())
                done.append(f"{n} ({int(fill.sum())} of {p.numel()} entries)")
    if not done:
        return None
    return (f"the non-finite entries of {', '.join(done)} were re-run from the values the "
            "factory builds for them: the step's own code wrote them in place, so the bundle "
            "lost what the step began with; they are those values while no update has moved "
            "them (a padding row, whose gradient is 0)")
