"""A 0 a distribution refused that float64 keeps far above the type's smallest normal number:
no underflow made it (no softplus or exp of a very negative input, whose advice is a floor on
that op) but the rounding of an earlier op, as Trajectron++'s Cholesky factor of a bivariate
Gaussian, ``sigma_y * sqrt(1 - rho²)``, whose ``rho = tanh(.)`` float32 rounded to 1.0 (float64
has 1e-4 there). The maker op's float64 output, captured in the float64 re-run at the same
call, gives the refused entries' values."""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode
from .dispatch import run_op
from .source import user_source


class MadeAt(TorchDispatchMode):
    """Keeps the output of the first call of ``op`` at user line ``source`` whose output has
    ``shape``: the float64 re-run's value of the tensor the refused one was made as (matched
    by line and shape, not by count: the recorded run's hooks call ops too)."""

    def __init__(self, op: str, source: str, shape: torch.Size):
        super().__init__()
        self.name, self.source, self.shape = op.removeprefix("aten."), source, shape
        self.outputs: list[torch.Tensor] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        if self.outputs is None and func.overloadpacket.__name__ == self.name \
                and isinstance(out, torch.Tensor) and out.shape == self.shape \
                and user_source() == self.source:
            self.outputs = [out.detach()]
        return out


def capture(maker, value) -> MadeAt | None:
    """The float64 re-run's capture of the op that made the refused ``value``."""
    if not maker or not maker[0] or not maker[2] or value is None:
        return None
    return MadeAt(maker[0], maker[2], value.shape)


def float64_zeros(at: MadeAt | None, value, valid, constraint) -> torch.Tensor | None:
    """The float64 values of the refused 0 entries (a Cholesky factor's: on its diagonal),
    when the maker's captured output has the refused value's shape; else None."""
    if at is None or not at.outputs or value is None or valid is None:
        return None
    out = at.outputs[0]
    if out.shape != value.shape:
        return None
    zero = (value == 0) & ~valid
    if "Cholesky" in str(constraint) and value.dim() >= 2 and value.shape[-1] == value.shape[-2]:
        zero, out = (torch.diagonal(t, dim1=-2, dim2=-1) for t in (zero, out))
    if not bool(zero.any()):
        return None
    return out[zero.to(out.device)].double().cpu()


def rounded_hint(refused: str, seen: str, v64: torch.Tensor | None, dtype) -> str | None:
    """The ``precision`` hint when every refused 0 is, in float64, at least ``dtype``'s
    smallest normal number; else None (an underflow, or not known)."""
    if v64 is None or not v64.numel() or not dtype.is_floating_point:
        return None
    tiny = torch.finfo(dtype).tiny
    if not bool((v64.abs() >= tiny).all()):
        return None
    return (f"{refused}: {seen}; float64 has them from {float(v64.abs().min()):.3g}, far above "
            f"{str(dtype).removeprefix('torch.')}'s smallest normal number {tiny:.3g}, so no "
            "underflow made them: an earlier op's rounding did (1 − ρ² of a correlation "
            "ρ = tanh(·) rounded to 1.0, a variance E[x²] − E[x]² cancelled to 0): keep that "
            "value inside its range before it is used (ρ.clamp(−1 + eps, 1 − eps)), or add a "
            "floor to the refused value (+ 1e-6)")
