"""An exp that overflowed on a cumulative sum: chunkwise linear attention's decays.

Gated linear attention, RetNet's and Mamba-2's chunkwise forms take ``b = cumsum(log gates)``
over a chunk and scale queries by ``exp(b)``, keys by ``exp(-b)``: ``exp(-b)`` grows with the
chunk's length until it overflows once the gates' logs sum below -88 (float32). The generic
advice for an exp's overflow (subtract the row max) misses the form that is finite by
construction: exp of differences of the running sum that are never positive. Only for an exp
origin: the forward re-run of ``replay.exp_overflow`` follows the cumsum's output (through
views, negation, scaling and dtype casts) into the exp at the origin's line.
"""

from __future__ import annotations

import torch

from .memo import TensorSet
from .source import user_source

# ops that pass a running sum on as one (a view, a sign, a scale, a cast)
_PASS = {"neg", "view", "_unsafe_view", "reshape", "transpose", "permute", "select", "slice",
         "unsqueeze", "squeeze", "expand", "clone", "contiguous", "_to_copy", "alias",
         "mul", "div", "unflatten", "flatten", "narrow"}


class CumsumFollowed:
    """Marks cumsum outputs and what passes them on; ``found``: the line of the cumsum whose
    value the exp at ``at`` (op, line) took when it made +inf."""

    def __init__(self, at: tuple[str, str | None]):
        self.at, self.sums = at, TensorSet()
        self.lines: dict[int, str | None] = {}
        self.found: str | None = None

    def see(self, name: str, args, out: torch.Tensor, first: torch.Tensor) -> None:
        """One op of the re-run (``replay.exp_overflow``), until ``found``."""
        if name == "cumsum":
            self.sums.add(out)
            self.lines[id(out)] = user_source()
        elif name in _PASS and first in self.sums and not any(
                isinstance(a, torch.Tensor) and a.dim() for a in args[1:]):
            self.sums.add(out)  # (scaled by a number, not by another tensor)
            self.lines[id(out)] = self.lines.get(id(first))
        elif f"aten.{name}" == self.at[0] and first in self.sums \
                and user_source() == self.at[1] and bool(torch.isposinf(out.detach()).any()):
            self.found = self.lines.get(id(first)) or "?"


def cumsum_exp_text(hit, found: str) -> str:
    """The hint for an exp origin ``hit`` that overflowed on the cumulative sum made at
    ``found`` (see :class:`CumsumFollowed`) taken as is, not a difference of two: exp of
    differences of it that stay at or below 0."""
    return (f"{hit.op} took a cumulative sum (made at {found}) as it is: exp of a "
            "running sum of log gates or decays grows with the length it runs over, until it "
            "passes the type's range (88.7 in float32) however the inputs are scaled; take exp "
            "only of differences of the sum that are never positive (the keys' exp(b_last - "
            "b), the pairwise exp(b_i - b_j) masked to j <= i within a chunk, as "
            "flash-linear-attention's chunkwise GLA and Mamba-2's segsum do), or shorter "
            "chunks")
