"""An exp that overflowed whose input is a trained parameter negated: Kendall's
uncertainty weighting ``exp(-s) * L + s`` with the log-variances ``s`` in the loss module
(``<loss>.log_vars``), a learned log-temperature or log-scale. The parameter drifted until its
exp left the type's range (a task whose loss is 0, no record labelled for it, has ``d/ds = 1``
for ever and ``s`` falls without bound); the fix is to bound that parameter, not to subtract a
row max. Followed in one forward re-run by ``replay.exp_overflow``. (A parameter taken as is
is the op's own input, named by ``replay.forward.with_param_advice``.)"""

from __future__ import annotations

import math

import torch

from .memo import TensorMarks
from .softplus_overflow import ExpFollowed

# ops that pass a parameter's values on unchanged, or negated
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "clone", "_to_copy", "contiguous",
          "unsqueeze", "squeeze", "select", "alias", "detach"}


def trained_params(runner) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and, as ``<loss>.NAME``, the loss module's."""
    named = [(n, p) for n, p in runner.model.named_parameters()]
    loss = getattr(runner.step, "loss_fn", None)
    if isinstance(loss, torch.nn.Module):
        named += [(f"<loss>.{n}", p) for n, p in loss.named_parameters()]
    return named


class ParamExpFollowed(ExpFollowed):
    """``found``: (name, sign, lowest, highest) where the exp at ``at`` took a parameter
    (times ``sign``: -1 through a neg)."""

    def __init__(self, at, params: list[tuple[str, torch.Tensor]]):
        super().__init__(at)
        self.params = params
        self.marks = TensorMarks()
        self.hit: tuple | None = None

    def _of(self, t) -> tuple[str, int] | None:
        if (m := self.marks.get(t)) is not None:
            return m
        for name, p in self.params:
            if isinstance(t, torch.Tensor) and t.shape == p.shape and p.numel() \
                    and t.data_ptr() == p.data_ptr() and t.dtype == p.dtype:
                return name, 1
        return None

    def see(self, name: str, args, out: torch.Tensor, first: torch.Tensor) -> None:
        src = self._of(first)
        if self.marked(name, out):
            if src is not None and src[1] < 0 and out in self.exps:
                v = first.detach().float().flatten()  # (exp's argument: sign * the parameter)
                self.hit = (src[0], src[1], float(v.min()), float(v.max()), int(v.argmax()))
                self.found = src[0]
            return
        if src is not None and name in _VIEWS | {"neg"}:
            self.marks.put(out, (src[0], -src[1] if name == "neg" else src[1]))


def param_exp_text(hit, found: tuple) -> str:
    """The hint for an exp origin ``hit`` whose input was parameter ``found`` (see
    :class:`ParamExpFollowed`)."""
    name, sign, lo, hi, at = found
    dt = hit.evidence.dtype if hit.evidence is not None else torch.float32
    edge = math.log(torch.finfo(dt).max)
    arg = f"-{name}" if sign < 0 else name
    way = "down" if sign < 0 else "up"
    return (f"{hit.op}'s input is {arg}, the trained parameter {name} negated (exp's "
            f"argument from {lo:.4g} to {hi:.4g}, {hi:.4g} at flat index {at}, beyond "
            f"{edge:.3g} where {str(dt).removeprefix('torch.')} overflows): the parameter "
            f"drifted {way} step after step. A learned log-variance of uncertainty weighting (exp(-s) * L + s) "
            "falls without bound when its task's loss is 0 (no record labelled for it: "
            "d/ds = 1 for ever), a learned log-temperature or log-scale likewise: bound it "
            f"where it is used ({name}.clamp(-10, 10)), leave a task with no labelled record "
            "out of the sum, and check its learning rate")
