"""Gradients the autograd engine summed into an infinity before any node ran.

A value used several times in the forward (a rollout's state, which the next step's force,
position update and policy all read; a parameter every step reuses) receives one gradient
per use, and the engine adds them up before calling the node that made the value. Each of
those gradients can be finite and their sum not: no node returned the infinity, so the
first node to make a non-finite gradient from finite ones does not exist, and the report
named no node at all. The node the sum was meant for is the origin then, and the sum is
what made the value.
"""

from __future__ import annotations

import math

import torch

from recorder.finite import finite


class SummedGrads:
    """What the nodes watched so far sent each node: how many finite gradients and the sum of
    their largest magnitudes (a sum of finite terms overflows only past the type's largest
    value), and which nodes they sent a non-finite gradient."""

    def __init__(self):
        self._finite: dict = {}  # node -> (finite gradients sent to it, their absmax summed)
        self._bad: set = set()

    def sent(self, node, grad_inputs) -> None:
        """After watched node ``node`` ran, returning ``grad_inputs`` to its next nodes."""
        for (target, _), g in zip(node.next_functions, grad_inputs):
            if target is None or not isinstance(g, torch.Tensor):
                continue
            try:  # (NaN or inf: not finite)
                top = float(g.detach().abs().max()) if g.numel() else 0.0
            except RuntimeError:  # (a sparse or nested gradient: no magnitude, never summed)
                top = 0.0 if finite(g) else math.nan
            if math.isfinite(top):
                n, total = self._finite.get(target, (0, 0.0))
                self._finite[target] = (n + 1, total + top)
            else:
                self._bad.add(target)

    def overflowed(self, node, grad_outputs) -> int:
        """How many finite gradients the engine summed into ``node``'s incoming gradient
        ``grad_outputs`` when that is +-inf and those alone can make it: at least two, whose
        largest magnitudes add up past the type's largest value, and no watched node sent it
        a non-finite one (else 0: an unwatched node, a double backward's, may have)."""
        n, total = self._finite.get(node, (0, 0.0))
        if n < 2 or node in self._bad:
            return 0
        bad = [g for g in grad_outputs if isinstance(g, torch.Tensor) and not finite(g)]
        if not bad or bool(bad[0].isnan().any()):  # (a sum of finite terms makes no NaN)
            return 0
        return n if total >= torch.finfo(bad[0].dtype).max else 0


def detail(made: str | None, node: str, uses: int, module: str | None) -> str:
    """The origin's sentence (instead of an op) for such a sum."""
    where = f" in {module}" if module else ""
    return (f"{made} made by the sum of {uses} finite gradients that the {uses} uses of "
            f"{node}'s value sent back{where} (no node returned it: the autograd engine "
            "added them up)")
