"""A quotient's divisor the model predicts that a ReLU cut to exactly 0.

A scale hyperprior whose ``GaussianConditional`` lost its scale bound divides by the scales
``h_s`` ends with a ReLU: where the ReLU is 0, ``(0.5 - |y|) / 0`` is +-inf, erfc makes it 0 or
2 and the likelihood is finite, so the forward hides it, but ``DivBackward0``'s gradient is NaN.
The generic hint (mask the value out, add an eps) sends the user to the wrong place: the
divisor is learned, and non-negative is not enough for a divisor; it needs a lower bound.
"""

from __future__ import annotations

import torch

from .compat import saved_value
from .positive import node_op

# ops whose output is exactly 0 wherever they cut their input (relu, clamp(min=0), relu6)
_CUTS = {"Relu", "Threshold", "Clamp", "ClampMin", "Hardtanh", "Relu6"}
# ops that move or pick values without changing them: the divisor's 0 is still the cut's
_MOVES = {"View", "UnsafeView", "Reshape", "ReshapeAlias", "Permute", "Transpose", "T",
          "Expand", "Squeeze", "Unsqueeze", "Split", "SplitWithSizes", "Chunk", "Slice",
          "Select", "Clone", "Contiguous", "Flatten", "Unbind", "Index", "Narrow"}


def clamped_to_zero(node, depth: int = 8) -> bool:
    """``node`` is a quotient's backward whose divisor, a learned value (a gradient reaches
    it), holds an exact 0 that a ReLU-like cut made, reached through views and selections."""
    try:
        if node_op(node) != "Div" or (up := node.next_functions[1][0]) is None:
            return False
        other = saved_value(node, "other")
        if not isinstance(other, torch.Tensor) or not bool((other == 0).any()):
            return False
    except Exception:  # (a scalar divisor, a freed node: unknown)
        return False
    for _ in range(depth):
        if up is None or node_op(up) not in _MOVES:
            break
        up = up.next_functions[0][0]
    return up is not None and node_op(up) in _CUTS
