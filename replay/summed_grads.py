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

import torch

from recorder.finite import finite


class SummedGrads:
    """Which nodes received finite and non-finite gradients from the nodes watched so far."""

    def __init__(self):
        self._finite: dict = {}  # node -> how many finite gradients were sent to it
        self._bad: set = set()  # nodes some watched node sent a non-finite gradient

    def sent(self, node, grad_inputs) -> None:
        """After watched node ``node`` ran, returning ``grad_inputs`` to its next nodes."""
        for (target, _), g in zip(node.next_functions, grad_inputs):
            if target is None or not isinstance(g, torch.Tensor):
                continue
            if finite(g):
                self._finite[target] = self._finite.get(target, 0) + 1
            else:
                self._bad.add(target)

    def overflowed(self, node, grad_outputs) -> int:
        """How many finite gradients the engine summed into ``node``'s non-finite incoming
        gradient ``grad_outputs`` (0 when it is finite, when a node sent it an infinity, or
        when fewer than two watched nodes sent it anything: an unwatched one may have)."""
        n = self._finite.get(node, 0)
        if n < 2 or node in self._bad:
            return 0
        incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
        return n if incoming and not all(finite(g) for g in incoming) else 0


def detail(made: str | None, node: str, uses: int, module: str | None) -> str:
    """The origin's sentence (instead of an op) for such a sum."""
    where = f" in {module}" if module else ""
    return (f"{made} made by the sum of {uses} finite gradients that the {uses} uses of "
            f"{node}'s value sent back{where} (no node returned it: the autograd engine "
            "added them up)")
