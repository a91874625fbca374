"""A loss op that overflowed on the loss's data alone: no model output reaches its inputs.

Adaptive Wing loss computes ``pow(theta / eps, alpha - y - 1)`` of the target heatmap ``y``,
written for ``y`` in [0, 1]; a batch whose heatmaps were rendered as 8-bit images (0..255)
makes it ``0.5 ** -253``, beyond float32. The overflow hint said to subtract the row max
before exp or bound a learned exponent, but nothing the model makes or learns is in that
op: the data the loss was given is out of the range its formula was written for. The loss is
re-run under a dispatch mode that follows which values come from the model's outputs (or
the loss's parameters); when the op blamed took none of them, the hint says so and names the
loss's data arguments by their largest magnitude.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.capture import loss_path

from .batch_overflow import ADVICE as BATCH_SCALE
from .cause_text import DO
from .compat import TorchDispatchMode, tree_leaves
from .dispatch import run_op
from .load import Step, autocast_as_recorded, loss_inputs
from .rerun import Runner

# the overflow's generic advice (rescale, bound a learned exponent, float64), replaced when it
# ends the hint (advice added after it, an outlier's rows, stands)
_GENERIC = (DO["wider64_exp"], DO["wider64"])


class _Taint(TorchDispatchMode):
    """Whether the first op named ``op`` that made an infinity of finite values took a value
    made from ``seeds`` (the model's outputs, the loss's parameters). Only floating values
    carry it: a boolean mask the output chose (``y[delta < theta]``) picks the data's values,
    which stay the data's."""

    def __init__(self, seeds, op: str):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in seeds}
        self.made: dict[int, torch.Tensor] = {}  # (held, so that no id is reused)
        self.op = op
        self.learned: bool | None = None

    def _from_model(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (
            id(t) in self.made or t.untyped_storage().data_ptr() in self.ptrs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = run_op(func, args, kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tainted = any(self._from_model(t) for t in ins)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tainted:
            self.made.update((id(t), t) for t in outs if t.is_floating_point())
        if self.learned is None and f"aten.{func.overloadpacket.__name__}" == self.op \
                and _finite(ins) and not _finite(outs):
            self.learned = tainted
        return out


def _finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts if t.is_floating_point())


def data_overflow_hint(report: dict[str, Any], step: Step) -> None:
    """Replace an overflow's advice in the loss when its op took the loss's data alone."""
    # (its wording, which names the loss's arguments, replaces batch_overflow's general one)
    o, hint = report["origin"], (report.get("hint") or "").removesuffix(BATCH_SCALE)
    if report.get("cause") != "overflow" or o.get("phase") != "loss" \
            or o.get("module") != "<loss>" or o.get("made") not in ("+inf", "-inf") \
            or not hint.endswith(_GENERIC) or step.model is None or step.loss_fn is None:
        return
    mb = o.get("micro_batch") or 0
    try:
        run = Runner(step).run(backward=False, instrument=False)
        outs = [[t.detach() for t in out] for out in run.outputs]
        args, kwargs = loss_inputs(step, mb, outs, objects=run.objects)
        seeds = [t for out in outs for t in out]
        if isinstance(step.loss_fn, torch.nn.Module):
            seeds += [p.detach() for p in step.loss_fn.parameters()]
        watch = _Taint(seeds, o.get("op"))
        with torch.no_grad(), autocast_as_recorded(step.micro_batches[mb], step.device,
                                                   loss=True), watch:
            step.loss_fn(*args, **kwargs)
    except Exception:  # (the overflow's own advice stands)
        return
    if watch.learned is not False:
        return
    data = _largest(step, mb)
    tail = next(t for t in _GENERIC if hint.endswith(t))
    report["hint"] = hint[:-len(tail)].rstrip().rstrip(":") + (
        "; but no value the model made or learns reaches its inputs: it took the loss's data "
        f"alone{data} and constants, so the data holds values the formula was not written "
        "for. Check their scale where the data is made (a target heatmap rendered in "
        "[0, 255] where [0, 1] is meant, coordinates in pixels where normalised ones are), "
        "not the model's; or bound what the formula takes (y.clamp(0, 1))")


def _largest(step: Step, mb: int) -> str:
    """`` (loss_args[1] up to 255)``: the loss's floating data arguments, largest first."""
    entry = step.micro_batches[mb]
    sizes = []
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                and isinstance(raw, str):
            big = float(t.detach().abs().max())
            if math.isfinite(big):
                sizes.append((big, loss_path(raw)))
    sizes.sort(reverse=True)
    return " (" + ", ".join(f"{n} up to {b:.4g}" for b, n in sizes[:2]) + ")" if sizes else ""
