"""A value made by a long chain of products with only views between them: a running vector
or matrix multiplied by one factor per step of a loop and never rescaled (a partition function
contracted through transfer matrices, an MPS's boundary vector over its sites, an HMM's forward
pass without scaling). Its magnitude moves geometrically with the chain's length, so its 0 or
its infinity is the chain's own: the fix is to rescale at each step and carry the log of the
scale, not to clamp (which changes the value by orders of magnitude) or widen the type (which
only postpones it)."""

from __future__ import annotations

from .positive import node_op

# autograd nodes of products (matmul and einsum run as these), and of views between them
_PRODUCTS = {"Mm", "Bmm", "Mv", "Dot", "Vdot", "Mul"}
_VIEWS = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze", "Expand",
          "Permute", "Transpose", "T", "Clone", "Alias"}
PRODUCT_OPS = {"aten.mm", "aten.bmm", "aten.mv", "aten.dot", "aten.matmul", "aten.mul"}
LEAST = 8  # chained products: fewer is a formula's product, not a chain
_MOST = 4096  # graph nodes visited at most

CHAIN = ("it is the end of a chain of {n} products with no rescaling between them (a "
         "partition function contracted through transfer matrices, an MPS's boundary vector "
         "over its sites, an HMM's forward pass), whose magnitude moves geometrically with "
         "the chain's length: divide the running product by its norm at each step and add "
         "the log of that norm to a log-scale total (log Z = the sum of those logs plus the "
         "log of what is left); a clamp would change the value by orders of magnitude, and a "
         "wider type only postpones it")

RUNNING = ("; if that loop multiplies a running value by one factor per run (a product over a "
           "chain: an MPS's sites, transfer matrices, an HMM's forward pass), the growth is the "
           "chain's own: divide the running value by its norm at each run and carry the log of "
           "the norm")


def chain_length(t) -> int:
    """The most products chained through views alone on the autograd graph ending at tensor
    ``t`` (0 off the graph, or past :data:`_MOST` nodes)."""
    root = getattr(t, "grad_fn", None)
    if root is None:
        return 0
    depth: dict = {}
    stack, seen = [(root, False)], 0
    try:
        while stack:
            node, done = stack.pop()
            if node in depth:
                continue
            op = node_op(node)
            kids = [f for f, _ in node.next_functions if f is not None] \
                if op in _PRODUCTS or op in _VIEWS else []
            if not done:
                seen += 1
                if seen > _MOST:
                    return 0
                stack.append((node, True))
                stack.extend((k, False) for k in kids if k not in depth)
                continue
            below = max((depth.get(k, 0) for k in kids), default=0)
            depth[node] = below + (op in _PRODUCTS)
    except Exception:  # not an autograd node, or one that cannot say
        return 0
    return depth.get(root, 0)
