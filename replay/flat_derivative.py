"""Which op's own derivative made a backward origin's incoming gradient 0, where no mask did.

A backward origin flagged ``masked`` (:mod:`replay.masked_grad`) made NaN only where the
gradient entering it is 0, which was read as a mask the forward applied after the op (a
``torch.where`` branch, ``masked_fill``). A 0 gradient also comes from an op whose derivative
is 0 at the value it took: an edge loss's ``|mag(pred) - mag(target)|`` of two gradient
magnitudes both 0 on a flat (blank) frame sends ``sign(0) = 0`` into ``sqrt(gx² + gy²)``,
whose derivative at 0 is inf: 0 * inf is NaN. Nothing masked those entries; the code does not
know them. The nodes that fed the origin its gradient are followed back through the ones that
pass a gradient on unchanged in its zeros (a difference, a view, a selection) to the first
that does not: abs, relu, sign, a threshold there is that op, said by name; a squared or
absolute error's node there made it as the residual of a sample the loss fits exactly.
"""

from __future__ import annotations

from .masked_grad import RESIDUAL_NODES
from .positive import node_op

# (they pass the incoming gradient's zeros on where they sit, making none: a sum or difference,
# a division, views; not a product, whose factor's 0 is a mask's)
_PASS = frozenset({
    "Sub", "Rsub", "Add", "Neg", "Div", "View", "Reshape", "UnsafeView", "Select", "Slice", "Unsqueeze",
    "Squeeze", "Expand", "Permute", "Transpose", "T", "Clone", "ToCopy", "Unbind", "Stack",
    "Cat", "Split", "SplitWithSizes", "Alias", "Contiguous"})
# (their derivative is 0 at the value they took there: a 0, or below a threshold)
_FLAT_AT = {"Abs": "abs", "Relu": "relu", "Sign": "sign", "Sgn": "sign",
            "Threshold": "a threshold (relu)", "Round": "round", "Floor": "floor"}


class Feeders:
    """Which node sent each node its gradient (the last one: a node used once, the usual
    case of an elementwise op's value, has one)."""

    def __init__(self) -> None:
        self._fed: dict = {}

    def hook(self, node):
        """A post-hook on ``node`` saying, when it runs, that it feeds each of its next
        functions; its handle."""
        def sent(grad_inputs, grad_outputs) -> None:
            for fn, _ in node.next_functions:
                if fn is not None:
                    self._fed[fn] = node
        return node.register_hook(sent)

    def zeroed_above(self, node, depth: int = 8) -> tuple[str | None, str | None]:
        """What made ``node``'s incoming gradient 0, where no mask did, following the nodes
        that fed it back through those that pass the zeros on: ``(op, None)`` for an op whose
        derivative is 0 at its value (abs, relu), ``(None, node name)`` for a squared or
        absolute error's node (its residual 0: replay.masked_grad), else ``(None, None)``."""
        for _ in range(depth):
            node = self._fed.get(node)
            if node is None:
                return None, None
            op = node_op(node)
            if op in _FLAT_AT:
                return _FLAT_AT[op], None
            if node.name() in RESIDUAL_NODES:
                return None, node.name()
            if op not in _PASS:
                return None, None
        return None, None
