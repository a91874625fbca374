"""A quotient's divisor the model predicts that a ReLU cut to exactly 0.

A scale hyperprior whose ``GaussianConditional`` lost its scale bound divides by the scales
``h_s`` ends with a ReLU: where the ReLU is 0, ``(0.5 - |y|) / 0`` is +-inf, erfc makes it 0 or
2 and the likelihood is finite, so the forward hides it, but ``DivBackward0``'s gradient is NaN.
The generic hint (mask the value out, add an eps) sends the user to the wrong place: the
divisor is learned, and non-negative is not enough for a divisor; it needs a lower bound.
So in the forward (:func:`cut_in_forward`): a latent SDE's KL integrand ``(f - h) / g`` with
the diffusion ``g = relu(.)`` is ``x / 0`` wherever the ReLU's input is negative.
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


# what the hint adds at a forward quotient by such a divisor (replay.upstream)
ADVICE = (
    "; but its divisor there is a value the model computes (a scale, a diffusion, a std) "
    "that a ReLU or clamp(min=0) made exactly 0: non-negative is not enough for a divisor; "
    "bound it below where it is made (softplus(x) + eps, exp of a learned log, "
    "clamp_min(eps)) instead of ending it with a ReLU, which an eps in this denominator "
    "would only patch")
_DIVIDES = {"div", "true_divide", "divide"}


def cut_in_forward(op: str, ins: list[torch.Tensor]) -> bool:
    """Forward op ``op`` (as the op finder sees it, inputs ``ins``) divided by a tensor
    holding an exact 0 that a ReLU-like cut made, on the autograd graph."""
    if op.removeprefix("aten.").split(".")[0].rstrip("_") not in _DIVIDES or len(ins) != 2:
        return False
    den = ins[1]
    try:
        return den.grad_fn is not None and bool((den == 0).any()) \
            and _cut(den.grad_fn, 8)
    except Exception:  # (a tensor or node that cannot be read here: say nothing)
        return False


def _cut(up, depth: int) -> bool:
    """``up`` is a ReLU-like cut, or reaches one through views and selections."""
    for _ in range(depth):
        if up is None or node_op(up) not in _MOVES:
            break
        up = up.next_functions[0][0]
    return up is not None and node_op(up) in _CUTS


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
    return _cut(up, depth)
