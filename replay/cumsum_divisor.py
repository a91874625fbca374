"""A division by a running sum that is still 0: linear attention's cumulative normaliser.

Causal linear attention (Katharopoulos et al.) and RetNet's recurrent form divide by
``z_t = sum_{s <= t} phi(k_s)`` (or ``q_t . cumsum(phi(k))_t``). With a feature map that is 0
on a whole range (``relu``) the running sum is exactly 0 at every position before its first
nonzero term: the leading positions of a left-padded row (a zero embedding through bias-free
projections), or a row whose first keys all fall below 0. The advice for 0/0 (an eps, skip
the rows, a padding id's zero row) says what happened there, not that the divisor is a running
sum nor that ``elu(x) + 1`` keeps it positive by construction: the hint gains that. Only for
an invalid division origin: one forward re-run follows the cumsum's output (through views,
casts, products and sums: the normaliser's dot product with the queries) into the divisor of
the op at the origin's line.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode, tree_leaves
from .dispatch import run_op
from .memo import TensorSet
from .source import user_source

# ops whose output is still the running sum, or made from it (a view, a cast, a product with
# the queries, a sum over features: zero wherever the sum is); not sub or add, which can
# move a zero
_PASS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "select", "slice",
         "unsqueeze", "squeeze", "expand", "clone", "contiguous", "_to_copy", "alias",
         "narrow", "flatten", "unflatten", "mul", "sum", "bmm", "mm", "einsum", "index",
         "unbind", "split", "chunk"}
_DIVS = {"div", "reciprocal"}


class _Following(TorchDispatchMode):
    """Marks cumsum outputs and what is made of them; ``found``: the cumsum's line once the
    division at ``at`` (op, line) took such a divisor and made a non-finite value."""

    def __init__(self, at: tuple[str, str]):
        super().__init__()
        self.at, self.sums = at, TensorSet()
        self.lines: dict[int, str | None] = {}
        self.found: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        if self.found is None:
            self._see(func.overloadpacket.__name__, args, out)
        return out

    def _mark(self, out, line: str | None) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.sums.add(t)
                self.lines[id(t)] = line

    def _see(self, name: str, args, out) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        summed = [t for t in tensors if t in self.sums]
        if name == "cumsum" and tensors and tensors[0].is_floating_point():
            self._mark(out, user_source())
        elif name in _PASS and summed:
            self._mark(out, self.lines.get(id(summed[0])))
        elif name in _DIVS and f"aten.{name}" == self.at[0] and user_source() == self.at[1]:
            divisor = args[-1] if name == "div" else args[0]
            if isinstance(divisor, torch.Tensor) and divisor in self.sums \
                    and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
                self.found = self.lines.get(id(divisor)) or "?"


def cumsum_divisor_hint(runner, hint: str | None, cause: str, hit, loss: bool = False
                        ) -> str | None:
    """``hint`` for an invalid division origin ``hit`` whose divisor was made of a cumulative
    sum (see the module's docstring), with the running normaliser's sentence after what the
    readings before said (a Performer's kernel_epsilon of 0, a padding id's zero row), that of
    a loss's running sum with ``loss``; ``hint`` as it is otherwise."""
    if cause != "invalid" or not hint or hit is None or hit.source is None \
            or hit.op.rstrip("_") not in ("aten.div", "aten.reciprocal"):
        return hint
    follow = _Following((hit.op.rstrip("_"), hit.source))
    try:
        runner.run(backward=False, instrument=False, forward_ctx=lambda: follow)
    except Exception:  # (the hint as it is: this only says where the divisor came from)
        return hint
    if follow.found is None:
        return hint
    said = f"{hint}. Its divisor is made of a cumulative sum (at {follow.found}): a running "
    if loss:
        return (said + "sum is exactly 0 before its first nonzero term: a running mean's "
                "cumsum(mask) over a row whose leading positions are masked (left padding, "
                "no valid step yet), a risk set's or cumulative hazard's cumsum(exp(h)) "
                "whose head terms are 0 (underflowed, or weights of 0); divide by a count "
                "kept above 0 (cumsum(mask).clamp_min(1), den + eps) or leave the positions "
                "before the first nonzero term out of the loss")
    return (said + "normaliser (linear attention's z_t = sum of phi(k_s) up to t) is exactly 0 "
            "before its first nonzero term, at a left-padded row's leading positions (zero "
            "keys) or where a feature map that is 0 on a range (relu) zeroed every key so "
            "far; a strictly positive feature map (elu(x) + 1) keeps it above 0 by "
            "construction, as an eps in the normaliser (z + eps) or the padded positions "
            "masked out of the division do")
