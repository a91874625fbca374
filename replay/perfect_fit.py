"""A loss's pole at 0 where the model's output equals its target exactly: the error the op
took is 0 because the fit is perfect, not because a record is degenerate.

PSNR as a loss, ``-10 * log10(max² / mse)``: a residual denoiser initialised to the identity
(its last conv at 0) returns its input, and on a pair with no noise the input is the target,
so ``mse`` is 0 and ``max² / 0`` is inf; ``log(mse)`` and a relative error ``|y - t| / |y - t|``
have the same pole. The op's generic advice (an eps in the denominator) is half of it; the
hint names the two loss arguments that are equal, so the user sees the perfect fit (and a
pair whose input is its target, which teaches the model nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path

from .load import Step
from .rerun import Runner

# (the pole texts of replay.domains: "of 0 (a pole: 1/0)", "by 0 (x/0, a pole)", "log ... of 0")
_AT_ZERO = ("of 0 (", "by 0 (", "of 0 by 0")


def perfect_fit_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's pole at 0 the model output and target that are equal."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    mb = o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("phase") != "loss" \
            or not any(z in hint for z in _AT_ZERO) or mb >= len(step.micro_batches):
        return
    pair = _equal_pair(step, mb)
    if pair is None:
        return
    made, data = pair
    report["hint"] = (
        f"{hint}; that 0 is the error of a perfect fit: {made} equals {data} exactly in "
        "this step, every entry (the model returned its target: a residual net "
        "initialised to the identity given a pair with no noise, an input that is its own "
        "target), and a loss with a pole at a perfect fit (PSNR's 10 * log10(max**2 / mse), "
        "log(mse), a relative error) is infinite there: minimise the mse or l1 itself and "
        "report PSNR as a metric, or keep the error above 0 (mse.clamp_min(eps)); a pair "
        "whose input is its target teaches nothing, so check the data too")


def _equal_pair(step: Step, mb: int) -> tuple[str, str] | None:
    """(the model output, the loss's data argument) that are equal everywhere: the forward
    run again (the bundle keeps the loss's data, not the model's output)."""
    entry = step.micro_batches[mb]
    learned = set(entry.get("loss_grad_args") or ())
    data = [(loss_path(raw), step.tensors.get(key))
            for key, raw in (entry.get("loss_paths") or {}).items() if key not in learned]
    data = [(name, t) for name, t in data
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1]
    if not data or step.model is None:
        return None
    try:
        run = Runner(step).run(backward=False, instrument=False)
        outs = run.outputs[mb] if mb < len(run.outputs) else []
    except Exception:  # (the pole's own advice stands)
        return None
    for j, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            continue
        for name, t in data:
            if t.shape == out.shape and torch.equal(t.to(out.device, out.dtype), out.detach()):
                return ("the model's output" if len(outs) == 1
                        else f"the model's output {j}"), name
    return None
