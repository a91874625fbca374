"""A 0/0 or x/0 whose divisor is the batch's values plus one learned parameter of one entry
(MoDL's closed-form data consistency ``(mask * k + lam * F(S z)) / (mask + lam)``, its weight
started at 0 for "hard" consistency): the parameter is that divisor's eps, exactly 0 in this
step, so wherever the data's term is 0 (an unsampled k-space entry, a count of 0) nothing
keeps the divisor from 0. The hint names the parameter and asks to keep it positive by
construction, not to add an eps to the data."""

from __future__ import annotations

import torch

__all__ = ["offset_divisor_hint"]


def offset_divisor_hint(hint: str | None, cause: str, finder, hit, model: torch.nn.Module
                        ) -> str | None:
    """``hint`` with the parameter the blamed division's divisor was offset by named, where
    that parameter is exactly 0; else ``hint`` as it is."""
    name = finder.names.hit_divisor_offset
    if hint is None or name is None or cause != "invalid" or hit is None \
            or hit is not finder.first or "by 0" not in hint:
        return hint
    param = dict(model.named_parameters()).get(name)
    if param is None or param.numel() != 1 or float(param.detach()) != 0.0:
        return hint
    return (f"{hint}; the divisor is the data plus the parameter {name}, a learned weight "
            "exactly 0 in this step (as initialised, or where an update stepped it): it is "
            "that divisor's only eps, so wherever the data's term is 0 (an unsampled entry "
            "of a mask, a count of 0) the divisor is 0 in every sample alike: keep it "
            f"positive by construction (softplus({name}) + eps, or learn its log and use "
            ".exp()) or add a fixed eps to the divisor")
