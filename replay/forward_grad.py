"""A forward that differentiates itself: a Hamiltonian network returns ``autograd.grad`` of its
learned energy, a score model the gradient of its density (a loss differentiating the model,
a PINN's, likewise). An op of that backward (``aten.div``
inside ``SqrtBackward0``) may make the forward's first non-finite value; its pole is the input
of the forward op that made the node (``sqrt`` at 0), not a division the user wrote, so the
report names that node and the line of its forward op."""

from __future__ import annotations

import linecache

from .backward import _UNIT_POLE_NODES
from .cause_text import DO
from .ops import OpHit
from .source import node_source
from .twice_differentiated import forward_node


def derivative_words(hit: OpHit, again: OpHit | None, by: str = "the forward's own"
                     ) -> tuple[str, str | None, str]:
    """The node running ``hit``'s op, its forward line (``again``: the same op found in a
    re-run under :func:`replay.source.node_tracebacks`), and what to say of it; ``by``: whose autograd.grad
    ran the node."""
    name = hit.node.name()
    # (a node a first derivative made, hvp's second: the line of the forward op it derives)
    src = node_source(forward_node(again.node)) or node_source(again.node) \
        if again is not None and again.node is not None else None
    path, _, line = (src or "").rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    at = f" of {src}" + (f" ({text})" if text else "") if src else ""
    base = name.removesuffix("Backward0").removesuffix("Backward1")
    op = base.lower()
    # (a torch.func transform runs the same nodes: a contractive penalty's jacrev)
    took = f"{hit.op} ran in {name}, the derivative of the forward's {op}{at}, which {by} " \
        "torch.autograd.grad (or torch.func's jacrev, vjp, grad) took: "
    if base in _UNIT_POLE_NODES:  # (its pole is at the edge of its domain, not at 0)
        edge = "1" if op == "acosh" else "+-1"
        return name, src, (f"{took}that derivative is infinite where {op}'s input is {edge}; "
                           + DO[op if op in ("acosh", "atanh") else "unit"])
    return name, src, (
        f"{took}a pole of that derivative (sqrt or a norm "
        f"at 0, a division by 0) is at {op}'s input, so make that input safe before the op "
        "(torch.where(x > 0, x, 1)) or add an eps there, not at the division the backward "
        "does")


def with_node(origin: dict, hint: str | None, cause: str,
              node: tuple[str, str | None, str] | None) -> str | None:
    """``hint`` with the node's words, and the node in ``origin``. An invalid cause's own
    advice is for a division the user wrote: what it says happened is kept, up to its colon,
    and the node's advice given instead."""
    if node is None:
        return hint
    origin["node"], origin["node_source"] = node[0], node[1]
    said = _what_happened(hint) if hint and cause == "invalid" else hint
    return f"{said}; {node[2]}" if said else node[2]


def _what_happened(hint: str) -> str:
    """``hint`` up to its first colon outside parentheses (``aten.div of 0 by 0 (a pole: 1/0),
    which exact arithmetic makes too``): what happened, before the advice."""
    depth = 0
    for i, ch in enumerate(hint):
        depth += (ch == "(") - (ch == ")")
        if ch == ":" and depth == 0 and hint[i + 1:i + 2] == " ":
            return hint[:i]
    return hint
