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
from .perfect_fit import loss_pole, output_data_pairs

_NEGATIVE_DOMAIN = (DO["domain"], DO["log_domain"], DO["power_domain"])


def output_range_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's op out of its domain the model output's negative range
    beside the non-negative data it is compared with."""
    gate = loss_pole(report, step, _NEGATIVE_DOMAIN)
    found = gate and _ranges(step, gate[0])
    if found is None:
        return
    made, (lo, hi), name, (dlo, dhi) = found
    report["hint"] = (
        f"{report['hint']}; rather than clamping: {made} spans [{lo:.3g}, {hi:.3g}] while "
        f"{name}, which the loss compares it with, spans [{dlo:.3g}, {dhi:.3g}], never below "
        "0: the loss's formula (a metric written for values in [0, data_range]: SSIM, "
        "MS-SSIM, PSNR; a log-likelihood of intensities) takes the output in the data's range, and "
        "the output's negative values send it out of its domain; map the output into that "
        "range (a sigmoid head, (y + 1) / 2 of a tanh) or both into one range, and give the "
        "metric a data_range that matches")


def _ranges(step: Step, mb: int):
    """(the output's name, its (min, max), the data argument's name, its (min, max)) for a
    model output holding a negative value beside a data argument of its shape holding none."""
    for made, out, name, t in output_data_pairs(step, mb):
        out, t = out.float(), t.float()
        if bool(torch.isfinite(out).all()) and float(out.min()) < 0 \
                and bool(torch.isfinite(t).all()) and float(t.min()) >= 0:
            return (made, (float(out.min()), float(out.max())), name,
                    (float(t.min()), float(t.max())))
    return None
