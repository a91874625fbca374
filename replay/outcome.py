"""What a re-run of the rewind window (:mod:`replay.window`) found first at a step: its
outcome, from the run itself (a forward, a loss, or the gradients a loop dropped) before the
step's gradients and update are read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import tensors_kind

from .rerun import scalar_loss


@dataclass
class Outcome:
    """The first non-finite value of a run."""

    step: int
    phase: str  # "input", "forward", "loss", "backward" or "update"
    module: str | None = None
    call: int | None = None
    micro_batch: int | None = None
    params: list[str] = field(default_factory=list)
    kind: str | None = None
    op: str | None = None
    source: str | None = None
    chain: list[dict[str, Any]] = field(default_factory=list)
    domain: str | None = None  # an update's op out of its domain (replay.update_domain)
    stale_why: str | None = None  # what made its stale state non-finite (hint only, no JSON)
    zero_rate: float | None = None  # every lr 0: one the update is finite at (replay.zero_rate)
    state: str | None = None  # the optimizer state key an update left non-finite (a state event)

    def as_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("stale_why")
        for k in ("zero_rate", "state"):
            if out[k] is None:
                out.pop(k)
        return out


def run_outcome(k: int, run) -> Outcome | None:
    o = run.forward_origin()
    if o is not None and not run.loss_first(o):
        came_in = not run.strict_inf and run.chain()[2]
        kind = o.kind or ("nan" if o.nan else None)
        if came_in and o.micro_batch is not None and o.micro_batch < len(run.inputs):
            # the batch's own kind (its +inf, where the root's layers then made NaN of it), as
            # the report's origin says
            kind = kinds_of(t for t in run.inputs[o.micro_batch].values()
                            if isinstance(t, torch.Tensor) and t.is_floating_point()) or kind
        return Outcome(k, "input" if came_in else "forward", module=o.module, call=o.call,
                       micro_batch=o.micro_batch, kind=kind)
    if run.loss_finite and not all(run.loss_finite):
        j = run.loss_finite.index(False)
        mb = run.loss_micro_batches[j]
        loss = run.losses[j] if j < len(run.losses) else None
        # (a dict of terms, CompressAI's rate-distortion loss: its worst floating term's kind)
        kind = kinds_of([t for t in tensor_leaves(loss) if t.is_floating_point()])
        return Outcome(k, run.loss_phase(j), module="<loss>", micro_batch=mb, kind=kind or "nan")
    bad = next(((i, d) for i, d in sorted(run.dropped.items()) if d[0]), None)
    if bad is not None:  # the step's own gradients are finite: the loop dropped these
        return Outcome(k, "backward", micro_batch=bad[0] - 1, params=bad[1][0], kind=bad[1][1])
    return None


def kinds_of(tensors) -> str | None:
    return tensors_kind([t for t in tensors if t is not None])


def loss_value(run) -> float | None:
    """A re-run step's loss as the recorder's ring records it (``ring/loss``): the mean over the
    step's loss calls, which is what a loop accumulating ``loss_fn(...) / n`` over n
    micro-batches logs; their sum read n times training's loss (a 10x "jump" where a batch-size
    ramp doubled the micro-batches per step)."""
    vals = [t for loss in run.losses if (t := loss if isinstance(loss, torch.Tensor) else
                                         scalar_loss(loss)) is not None and t.numel() == 1]
    return sum(float(t.detach()) for t in vals) / len(vals) if vals else None
