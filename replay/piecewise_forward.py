"""A forward's division by a derivative the model took of itself, which its piecewise-linear
activations made 0.

A Lagrangian neural network solves for accelerations with the Hessian of its learned
``L(q, qdot)``: ``qddot = (dL/dq - d2L/dqdqdot qdot) / d2L/dqdot2`` (one degree of freedom; a
solve with the mass matrix ``d2L/dqdot2`` for more), taken with
``torch.autograd.grad(create_graph=True)`` inside ``forward``. With relu activations every
second derivative of the network is exactly 0: the mass matrix is 0 at every state, whatever
the weights, and the division makes inf or NaN in every sample. The op finder names the
division and an eps, which would leave accelerations that never train. As for a loss's
(:mod:`replay.piecewise_linear`), one forward more with each relu run as softplus tells it:
when the origin call's output is finite there, and a backward node ran inside the forward (the
model differentiated itself: a dead relu's 0 output divided is no derivative), the hint names
the activations and a smooth one.
"""

from __future__ import annotations

import contextlib

from .compat import TorchDispatchMode, running_node
from .piecewise_linear import DIVIDES, PIECEWISE_LINEAR, Smooth
from .recorded import batch_size
from .rerun import Runner

FORWARD = (
    "; here the model's own forward took that derivative (torch.autograd.grad with "
    "create_graph=True, torch.func.hessian): a Lagrangian network's mass matrix d2L/dqdot2, a "
    "Hamiltonian's or an energy's Hessian, is 0 everywhere for a relu network, so the "
    "accelerations it divides by or solves with it never exist")


class _Derived(TorchDispatchMode):
    """Notes whether any op ran inside a backward node (a derivative the forward took)."""

    def __init__(self) -> None:
        super().__init__()
        self.derived = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.derived = self.derived or running_node() is not None
        return func(*args, **(kwargs or {}))


def forward_piecewise_hint(runner: Runner, o, hit, cause: str, hint: str | None,
                           origin: dict) -> str | None:
    """The hint naming the model's relus as what made a forward division's divisor, a
    derivative the forward took of itself, 0 (``o``: the origin call); else ``hint``. Only
    where every sample is non-finite (that derivative is 0 at every state: one re-run more
    for such an event alone)."""
    if cause != "invalid" or hit is None or hit.op not in DIVIDES or runner.model is None \
            or origin.get("samples") != list(range(batch_size(runner.step, o.micro_batch) or -1)):
        return hint
    seen: set[str] = set()
    derived = _Derived()

    @contextlib.contextmanager
    def ctx():
        with Smooth(seen), derived:
            yield

    try:
        run = runner.run(backward=False, instrument=True, forward_ctx=ctx)
    except Exception:  # (the hint as it is: this only says where the divisor's 0 came from)
        return hint
    finally:
        runner.reset()
    call = next((c for c in run.calls if (c.module, c.call, c.micro_batch)
                 == (o.module, o.call, o.micro_batch)), None)
    if not seen or not derived.derived or call is None or not call.outputs_finite:
        return hint
    return PIECEWISE_LINEAR.format(op=hit.op, names=", ".join(sorted(seen)),
                                   what="origin call's output") + FORWARD
