"""A loss's log (or division) at exactly 0 where the 0 is a constant the model's forward wrote
and never filled: a pointer-generator's extended vocabulary, ``cat([p_gen * p_vocab,
zeros(B, n_oov)])`` then ``scatter_add`` of the copy mass, holds 0 in the slots of OOVs the
sample's article lacks (or whose positions the attention masks: OOV words mapped to the
padding id). A target id pointing at such a slot (an OOV mapped through another article's
list), or a label-smoothing term summing ``log p`` over every slot, takes the log of that 0. The generic advice, an eps at the op, hides a wrong index or a slot that should not be
in the sum; the hint names the line that wrote the zeros.

Told by re-running the forward with the floating outputs of its zero-making ops (``zeros``,
``new_zeros``, ``zeros_like``, ``full`` of 0) set to a tiny positive mark: the loss is finite
then, and with the marks of one line alone (halving the lines that made zeros), which.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode
from .domains import describe
from .rerun import Runner
from .source import user_source

__all__ = ["UNFILLED", "unfilled_hint"]

UNFILLED = "those 0s are constants the model wrote"  # (replay.masked_overflow replaces it)

MARK = 2.0 ** -60  # positive, finite where a log or a division takes it, and rare
_POLES = {"aten.log", "aten.log2", "aten.log10", "aten.div", "aten.reciprocal"}
_ZEROS = {"aten.zeros.default", "aten.new_zeros.default", "aten.zeros_like.default"}
_FULL = {"aten.full.default": 1, "aten.new_full.default": 2, "aten.full_like.default": 1}


class _Marks(TorchDispatchMode):
    """Sets the zeros the model's forward makes (not the loss's) to ``MARK``: all of them, or
    those made on the lines ``only``; keeps the lines that made some."""

    def __init__(self, runner: Runner, mb: int, only: frozenset | None = None):
        super().__init__()
        self.runner, self.mb, self.only, self.lines = runner, mb, only, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if (name in _ZEROS or (name in _FULL and _fill(name, args, kwargs) in (0, 0.0))) \
                and isinstance(out, torch.Tensor) and out.is_floating_point() \
                and not self.runner.in_loss and self.runner.micro_batch == self.mb:
            line = user_source()
            if line not in self.lines:
                self.lines.append(line)
            if self.only is None or line in self.only:
                out.fill_(max(MARK, torch.finfo(out.dtype).tiny))  # (float16's too)
        return out


def _fill(name: str, args, kwargs) -> object:
    at = _FULL[name]  # (the fill value's position)
    return (kwargs or {}).get("fill_value", args[at] if len(args) > at else None)


def _finite_with(runner: Runner, mb: int, only: frozenset | None = None
                 ) -> tuple[bool, list]:
    marks = _Marks(runner, mb, only)
    run = runner.run(backward=False, instrument=False, forward_ctx=lambda: marks)
    if mb not in run.loss_micro_batches:
        return False, marks.lines
    return run.loss_finite[run.loss_micro_batches.index(mb)], marks.lines


def _one_line(runner: Runner, mb: int, lines: list) -> str | None:
    """The one line whose zeros alone make the loss finite, by halving (a forward each)."""
    while len(lines) > 1:
        half = len(lines) // 2
        lines = next((part for part in (lines[:half], lines[half:])
                      if _finite_with(runner, mb, frozenset(part))[0]), None)
        if lines is None:  # (zeros of several lines together: name none)
            return None
    return lines[0] if lines else None


def unfilled_hint(runner: Runner, mb: int, hit, cause: str, hint: str | None) -> str | None:
    """The hint for a loss op at its pole of 0 (``hit``, cause ``invalid``) naming where the
    model wrote that 0 as a constant, when marking the model's constant zeros makes the loss
    finite (it replaces ``hint``'s advice, an eps at the op); else ``hint``."""
    if hint is None or hit is None or cause != "invalid" or hit.op not in _POLES \
            or runner.model is None or hit.input_min != 0:
        return hint
    try:
        finite, lines = _finite_with(runner, mb)
        if not finite:
            return hint
        line = _one_line(runner, mb, lines)
    except Exception:  # (a model the extra re-runs cannot take: the hint as it was)
        return hint
    where = f"the zeros made at {line}" if line else "zeros the model's forward made"
    what = describe(hit.op.removeprefix("aten."), hit.evidence)[0] if hit.evidence else hit.op
    return (f"{what}: {UNFILLED}, not values that rounded to 0: "
            f"{where} reached {hit.op} unchanged (entries only zeros were added to since: an "
            "extended vocabulary's slots of OOVs a sample's article lacks, or of words at "
            "positions its attention masks); with them set to a tiny positive value the loss "
            "is finite. Check the index that picks such a slot (a target id mapped to a slot "
            "its own sample never fills) or the mask (a source position the mask hides: an "
            "OOV id mapped to the padding id), or leave the unfilled entries out of the op; an "
            "eps at the op would hide them behind a huge finite value")
