"""A loss's division by a derivative of the model that its piecewise-linear activations made 0.

A network of ReLUs is piecewise linear in its input: its first derivative is piecewise
constant, and every derivative beyond it is exactly 0 (autograd's derivative of relu's own
derivative is 0). A physics-informed loss that takes ``u_xx`` of such a network with
``torch.autograd.grad(..., create_graph=True)`` and divides by it, or by a statistic of it (a
residual scaled by the curvature's size, ``u_xx.abs().mean()``), is 0/0 at every step whatever
the weights: the op finder names the division and an eps, which would keep a residual that never
trains. Told apart by one forward and loss more with each relu (and leaky relu) the model and the
loss call replaced by a smooth one (softplus): when that loss is finite, the activation's zero
derivative made the divisor, and the fix is a smooth activation (tanh, sin, softplus, SiLU).
Only where the micro-batch's input required grad (the loss differentiates by it): a divisor a
dead relu's output made 0 (``relu(h).sum()``) is no derivative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .rerun import Runner
from .zero_head import zero_head_hint

DIVIDES = {"aten.div", "aten.reciprocal", "aten.rsqrt"}
_RELU = {torch.relu, torch.relu_, F.relu, F.relu_, F.leaky_relu, F.leaky_relu_}
_BETA = 10.0  # (softplus's sharpness: close to relu, with a nonzero second derivative)

PIECEWISE_LINEAR = (
    "{op}'s divisor is a derivative of the model's output that its piecewise-linear "
    "activations ({names}) made 0: a relu network is linear between its kinks, so every "
    "derivative of it beyond the first is exactly 0 (its u_xx, its Hessian), at every point and "
    "whatever the weights; with a smooth activation in their place the {what} is finite. A loss "
    "built of second derivatives (a PINN's residual of a diffusion or wave operator) needs a "
    "smooth activation: tanh, sin, softplus or SiLU instead of relu; an eps on the divisor "
    "would leave that term 0, a residual that never trains"
)


class Smooth(TorchFunctionMode):
    """Each relu or leaky relu called inside, as softplus of the same slope(s); the names of
    the functions it replaced."""

    def __init__(self, seen: set[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RELU or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        self.seen.add("leaky_relu" if "leaky" in func.__name__ else "relu")
        x = args[0]
        slope = args[1] if len(args) > 1 and "leaky" in func.__name__ \
            else kwargs.get("negative_slope", 0.0 if "leaky" not in func.__name__ else 0.01)
        soft = F.softplus(x, beta=_BETA)
        return soft if not slope else slope * x + (1 - slope) * soft


def piecewise_linear_hint(runner: Runner, mb: int, hit, cause: str,
                          hint: str | None) -> str | None:
    """The hint naming the model's relus as what made a loss's divisor 0, when micro-batch
    ``mb``'s loss is finite with smooth activations in their place; else ``hint``."""
    if cause != "invalid" or hit is None or hit.op not in DIVIDES or runner.model is None \
            or not runner.step.micro_batches[mb].get("grad_inputs"):
        return hint  # (no input to differentiate by: a relu's 0 output is another story)
    seen: set[str] = set()
    try:
        run = runner.run(backward=False, instrument=False, forward_ctx=lambda: Smooth(seen))
    except Exception:  # (the hint as it is: this only says where the divisor's 0 came from)
        return hint
    finally:
        runner.reset()
    if not seen or mb not in run.loss_micro_batches \
            or not run.loss_finite[run.loss_micro_batches.index(mb)]:
        return hint
    return PIECEWISE_LINEAR.format(op=hit.op, names=", ".join(sorted(seen)), what="loss")


def zero_divisor_hint(runner: Runner, mb: int, hit, cause: str, hint: str | None) -> str | None:
    """A loss's division at its pole in every sample, by what the model made 0: a weight
    matrix all 0 (:mod:`replay.zero_head`), else its relus' derivative (above); ``hint``
    otherwise."""
    named = zero_head_hint(runner, mb, hit, cause, hint)
    return named if named is not hint else piecewise_linear_hint(runner, mb, hit, cause, hint)
