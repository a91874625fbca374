"""A gradient that entered the model's output non-finite only at samples whose output is <= 0.

A loss the replay cannot re-run (DeepXDE's PDE residual, computed inside ``model.train``;
a loop's own ``torch.log(u)``) is named only by the gradient it sent into the output. When the
output holds one value per sample and the samples that gradient entered non-finite are all
among those where the output is at most 0, while others are positive, the loss most likely
took a log, a sqrt or a fractional power of the output outside its domain (the gradient of
``log(u)`` at ``u < 0`` is finite, but ``log(u)`` is NaN and carries NaN back): the sentence
says so, with the counts, and how to keep the output positive. One forward re-run, no backward.
"""

from __future__ import annotations

import torch

from .rerun import Runner

TEXT = (
    ". The gradient entered non-finite only at samples where the model's output is at most 0 "
    "({bad} of the {nonpos} samples with an output <= 0; none of the {pos} with a positive "
    "one): the loss most likely takes a log, a sqrt or a fractional power of the output "
    "(log(u) in a PDE residual, sqrt(u) of a predicted variance), NaN where it is <= 0; keep "
    "the output positive where the formula needs it (softplus or exp of the network's "
    "output, or an output transform), or clamp it before that op")


def nonpositive_output_text(runner: Runner, mb: int | None, rows: list[int] | None) -> str:
    """The sentence when the non-finite ``rows`` of micro-batch ``mb``'s entering gradient
    are all samples whose one-per-sample output is <= 0 and at least half of those, and some
    sample's output is positive; '' otherwise."""
    if not isinstance(mb, int) or not rows or runner.model is None:
        return ""
    try:
        run = runner.run(backward=False, instrument=False)
    except Exception:  # (only a sentence more: the report stands without it)
        return ""
    finally:
        runner.reset()
    outs = run.outputs[mb] if mb < len(run.outputs) else []
    out = next((o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()
                and o.dim() >= 1 and o.numel() == o.shape[0] > max(rows)), None)
    if out is None:
        return ""
    nonpos = set((out.detach().reshape(-1) <= 0).nonzero()[:, 0].tolist())
    pos = out.numel() - len(nonpos)
    # (a log of the output is NaN at most of them: a few NaN targets that happen to fall there
    # are no such op)
    if not pos or not set(rows) <= nonpos or len(rows) < 2 or 2 * len(rows) < len(nonpos):
        return ""
    return TEXT.format(bad=len(rows), nonpos=len(nonpos), pos=pos)
