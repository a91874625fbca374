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

import weakref
from typing import Any

import torch

from recorder.capture import loss_path

from .load import Step
from .rerun import Runner

# (the pole texts of replay.domains: "of 0 (a pole: 1/0)", "by 0 (x/0, a pole)", "log ... of 0")
_AT_ZERO = ("of 0 (", "by 0 (", "of 0 by 0")
# (a backward node's: replay.cause_text's "the derivative of sqrt has a pole at the op's input")
_DERIVATIVE_POLE = "has a pole at the op's input"


def perfect_fit_hint(report: dict[str, Any], step: Step) -> None:
    """Append to a loss origin's pole at 0 the model output and target that are equal."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    mb = o.get("micro_batch") or 0
    backward = o.get("phase") == "backward" and o.get("module") == "<loss>" \
        and _DERIVATIVE_POLE in hint  # (an RMSE's sqrt(mse) at 0: 1 / (2 sqrt(0)))
    at_zero = o.get("phase") == "loss" and any(z in hint for z in _AT_ZERO)
    if report.get("cause") != "invalid" or not (at_zero or backward) \
            or mb >= len(step.micro_batches):
        return
    rows = [r for r in o.get("samples") or () if isinstance(r, int) and r >= 0]
    pair = _equal_pair(step, mb, rows)
    if pair is None:
        return
    made, data, where = pair
    report["hint"] = (
        f"{hint}; that 0 is the error of a perfect fit: {made} equals {data} exactly in "
        f"this step, {where} (the model returned its target: a residual net "
        "initialised to the identity given a pair with no noise, a persistence forecast of "
        "a flat series, an input that is its own "
        f"target), and {_BACKWARD if backward else _FORWARD}; a pair whose input is its "
        "target teaches nothing, so check the data too")


_FORWARD = (
    "a loss with a pole at a perfect fit (PSNR's 10 * log10(max**2 / mse), log(mse), a "
    "relative error) is infinite there: minimise the mse or l1 itself and report PSNR as a "
    "metric, or keep the error above 0 (mse.clamp_min(eps))")
_BACKWARD = (
    "a loss whose derivative has a pole at a perfect fit (an RMSE, sqrt(mse): "
    "mean_squared_error(squared=False); a norm of the error) has an infinite slope there: "
    "minimise the mse itself and report the RMSE as a metric, or take sqrt(mse + eps)")


def _equal_pair(step: Step, mb: int, rows: list[int]) -> tuple[str, str, str] | None:
    """(the model output, the loss's data argument, where) that are equal everywhere, or else
    in every row of ``rows`` (the origin's samples: a per-image PSNR, ``dim=(1, 2, 3)``, whose
    one clean pair is reproduced exactly while the batch's others are not): the forward run
    again (the bundle keeps the loss's data, not the model's output)."""
    for made, out, name, t in output_data_pairs(step, mb):
        where = _equal_where(t.to(out.dtype), out, rows)
        if where is not None:
            return made, name, where
    return None


def output_data_pairs(step: Step, mb: int):
    """Each (the output's name for the hint, the floating model output of micro-batch ``mb``
    detached, a loss data argument's name, that argument on the output's device) whose
    shapes match (see :func:`outputs_and_data`)."""
    pair = outputs_and_data(step, mb)
    if pair is None:
        return
    outs, data = pair
    for j, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            continue
        made = "the model's output" if len(outs) == 1 else f"the model's output {j}"
        for name, t in data:
            if t.shape == out.shape:
                yield made, out.detach(), name, t.to(out.device)


def loss_pole(report: dict[str, Any], step: Step, said: tuple[str, ...]
              ) -> tuple[int, list[int]] | None:
    """(micro-batch, sample rows) of an ``invalid`` loss origin whose hint says one of
    ``said`` (the op's domain or pole text) and whose micro-batch the bundle holds: the gate
    of the hints that compare the model's output with the loss's data; None otherwise."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    mb = o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("phase") != "loss" \
            or not any(z in hint for z in said) or mb >= len(step.micro_batches):
        return None
    return mb, [r for r in o.get("samples") or () if isinstance(r, int) and r >= 0]


def outputs_and_data(step: Step, mb: int) -> tuple[list, list] | None:
    """(the model's outputs of micro-batch ``mb``, run again, and the loss's floating data
    arguments as ``(name, tensor)``, those that take no gradient); None when the bundle keeps
    none of those or the forward cannot run (the bundle keeps the loss's data, not the model's
    output). The last step's answer is kept: the loss hints after this one ask it again."""
    held = _LAST.get("step")
    if held is not None and held() is step and _LAST.get("mb") == mb:
        return _LAST["found"]
    found = _outputs_and_data(step, mb)
    _LAST.update(step=weakref.ref(step), mb=mb, found=found)
    return found


_LAST: dict[str, Any] = {}  # step (a weak reference), mb, found: outputs_and_data's last


def _outputs_and_data(step: Step, mb: int) -> tuple[list, list] | None:
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
    except Exception:  # (the caller's hint stands)
        return None
    return list(outs), data


def _equal_where(t: torch.Tensor, out: torch.Tensor, rows: list[int]) -> str | None:
    """'every entry' where ``t`` equals ``out``; else 'in sample(s) [...]' where they are equal
    in each of ``rows`` (fewer than the batch's) along the first dimension; else None."""
    if torch.equal(t, out):
        return "every entry"
    if not rows or out.dim() < 1 or len(rows) >= out.shape[0] or max(rows) >= out.shape[0]:
        return None
    idx = torch.tensor(rows, device=out.device)
    if not torch.equal(t.index_select(0, idx), out.index_select(0, idx)):
        return None
    if len(rows) == 1:
        return f"in sample {rows}, every entry of it"
    return f"in samples {rows}, every entry of each"
