"""A loss's op out of its domain (a negative base to a fractional power, log or sqrt of a
negative) where the model's output holds negative values while the data it is compared with
holds none: the output is not in the range the loss's formula was written for. A tanh head
(images in [-1, 1], the GAN convention) fed to torchmetrics' MS-SSIM with ``data_range=1`` and
``normalize=None``: the last scale's luminance term of a dark output against a [0, 1] target
is negative, and ``sim ** beta`` is NaN. The op's advice (clamp the base at 0) would hide the
mismatch; the hint names the two ranges and says to map the output into the data's."""

from __future__ import annotations

from typing import Any

import torch

from .cause_text import DO
from .load import Step
from .perfect_fit import outputs_and_data

_NEGATIVE_DOMAIN = (DO["domain"], DO["log_domain"], DO["power_domain"])


def output_range_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's op out of its domain the model output's negative range
    beside the non-negative data it is compared with."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    mb = o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("phase") != "loss" \
            or not any(a in hint for a in _NEGATIVE_DOMAIN) or mb >= len(step.micro_batches):
        return
    found = _ranges(step, mb)
    if found is None:
        return
    made, (lo, hi), name, (dlo, dhi) = found
    report["hint"] = (
        f"{hint}; rather than clamping: {made} spans [{lo:.3g}, {hi:.3g}] while {name}, "
        f"which the loss compares it with, spans [{dlo:.3g}, {dhi:.3g}], never below 0: the "
        "loss's formula (a metric written for values in [0, data_range]: SSIM, MS-SSIM, "
        "PSNR; a log-likelihood of intensities) takes the output in the data's range, and "
        "the output's negative values send it out of its domain; map the output into that "
        "range (a sigmoid head, (y + 1) / 2 of a tanh) or both into one range, and give the "
        "metric a data_range that matches")


def _ranges(step: Step, mb: int):
    """(the output's name, its (min, max), the data argument's name, its (min, max)) for a
    model output holding a negative value beside a data argument of its shape holding none."""
    pair = outputs_and_data(step, mb)
    if pair is None:
        return None
    outs, data = pair
    for j, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            continue
        out = out.detach().float()
        if not bool(torch.isfinite(out).all()) or float(out.min()) >= 0:
            continue
        for name, t in data:
            t = t.float()
            if t.shape == out.shape and bool(torch.isfinite(t).all()) and float(t.min()) >= 0:
                made = "the model's output" if len(outs) == 1 else f"the model's output {j}"
                return (made, (float(out.min()), float(out.max())), name,
                        (float(t.min()), float(t.max())))
    return None
