"""A backward node's NaN where the gradient entering it is 0: the op's output was dropped
after it (a known positive's distance set to -inf by ``masked_fill``, a ``torch.where``'s
other branch, a product with a mask's 0), yet the node still ran at those entries, and its
infinite derivative at the pole times that 0 is NaN. The pole's own advice (resample the
entry, clamp the input) reads as if the entry reached the loss; the mask the user wrote to
exclude it does not act on the backward, so the fix is a safe input before the op.

Not every 0 is a mask's: a squared or absolute error whose residual is exactly 0 (a duplicate
pair scored 1 whose angle regresses onto it: the prediction equals its target) sends 0 back
too (found on the path that fed the origin, :mod:`replay.flat_derivative`); a residual's
node says the loss is at its minimum there, and the clamp of the pole's input is the fix, no
mask to move.
"""

from __future__ import annotations

import torch

__all__ = ["FLAT_INCOMING", "HOOK_INCOMING", "MASKED_INCOMING", "RESIDUAL_INCOMING", "RESIDUAL_NODES",
           "zero_where_nan"]

MASKED_INCOMING = ("the gradient entering {node} is 0 at every entry where it made NaN: the "
                   "forward dropped the op's output there after the op (masked_fill, "
                   "torch.where, a product with a mask's 0), which does not stop the backward "
                   "(0 times the infinite derivative at the pole is NaN); make the masked "
                   "entries' input safe before the op (torch.where(mask, safe, x), or leave "
                   "them out of the op's input), not its output")

# the same 0, sent by an op's own derivative at the value it took (replay.flat_derivative)
FLAT_INCOMING = ("the gradient entering {node} is 0 at every entry where it made NaN, sent by "
                 "{by}'s derivative at the value it took there (0 for abs or sign of a "
                 "difference of two equal values, for relu at 0), not by a mask: 0 times the "
                 "infinite derivative at the pole is NaN; make the op's input safe before the "
                 "op (an eps inside it, torch.where(x > 0, x, 1))")

# a hook's (module backward (pre-)hook, tensor hook) own division of a gradient that came in
# as 0: no derivative has a pole there, the hook's divisor (that gradient's norm) is the 0
HOOK_INCOMING = ("the gradient the hook was given is 0 at every entry where it made NaN ({by}), "
                 "so a norm or statistic of it that the hook divides by is 0 too: guard the "
                 "hook's divisor (g / (g.norm() + eps), g.norm().clamp_min(eps)) or return the "
                 "gradient unchanged when it is all 0")

RESIDUAL_INCOMING = ("the gradient entering {node} is 0 at every entry where it made NaN, made "
                     "so by {zeroed} of an error exactly 0 there (the loss is at its minimum: "
                     "the prediction equals its target, a pair of identical texts scored as "
                     "identical), and 0 times the infinite derivative at the pole is NaN: the "
                     "input's guard is the fix, a sample the loss already fits still "
                     "differentiates through the op")

# backward nodes of a squared or absolute error: a 0 they return is a residual's 0
RESIDUAL_NODES = frozenset({"PowBackward0", "MseLossBackward0", "SmoothL1LossBackward0",
                            "HuberLossBackward0", "L1LossBackward0", "AbsBackward0"})


def zero_where_nan(grad_inputs, grad_outputs) -> bool:
    """Whether the node's first non-finite returned gradient is NaN only where the one
    incoming gradient of the same shape (an elementwise op's) is exactly 0."""
    outs = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
    if len(outs) != 1:
        return False
    bad = next((g for g in grad_inputs if isinstance(g, torch.Tensor)
                and not bool(torch.isfinite(g).all())), None)
    if bad is None or bad.shape != outs[0].shape:
        return False
    nan = torch.isnan(bad)
    return bool(nan.any()) and bool((outs[0][nan] == 0).all())
