"""A division by the module's own state, all 0 as the step began, that only holds a statistic
of a trained parameter all 0 (zero-initialised).

Delayed FP8 scaling (Transformer Engine, torchao's float8) keeps an amax history buffer that
the forward rolls and fills with the tensor's current amax before dividing ``fp8_max / amax``.
With a zero-initialised layer (GPT-2's / DiT's zero-init of a block's last projection) the
weight's amax is 0, the history stays 0, and the scale is inf. Filling the history with random
values hides it, as it would a power iteration's vector started at zeros, but the state is
not what is to start nonzero: the weight is 0 by design. Told apart by one forward more with
only the parameter filled with random values (the state left at 0): that call is finite too.
The fix is then a guard on the divisor, which costs nothing here since the scaled tensor is 0.
"""

from __future__ import annotations

ZERO_STATISTIC = (
    "{op}'s divisor comes from {state}, all 0 as the step began, which the forward fills "
    "with a statistic of {param}, all 0 too (initialised to zeros): with random values in "
    "that parameter alone the call is finite. A zero-initialised layer is a legitimate start, "
    "so the divisor made from its amax or norm must be guarded: clamp it (amax.clamp(min=eps), "
    "as torchao's amax_to_scale does; the tensor it scales is 0, so the eps costs nothing) or "
    "keep the previous scale where it is 0 (Transformer Engine: torch.where(amax > 0, "
    "fp8_max / amax, scale)); starting {state} nonzero only delays the same division")


def zero_statistic_hint(op: str, state: str, module, prefix: str, finite_without) -> str | None:
    """The hint when a trained parameter of ``module``, all 0, alone makes the divisor 0 (the
    state ``state`` only holds a statistic of it), else None. ``finite_without(t)``: whether
    the origin's call is finite with ``t`` filled with random values."""
    for name, p in module.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.numel() > 1 and not p.any() \
                and finite_without(p):
            return ZERO_STATISTIC.format(op=op, state=state, param=f"parameter {prefix}{name}")
    return None
