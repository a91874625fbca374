"""Where the model's outputs hold the samples when its forward moved them.

An occupancy network or an SDF draws points near each surface point and evaluates the field on
both, ``pts = torch.cat([x, x + sigma * noise])``: its output has twice the batch's rows, row
``r`` sample ``r % B``. A loss event re-runs the loss on the outputs alone, where their shape
does not say that, so the loss op's non-finite rows were named as no samples. :func:`follow`
re-runs the forward under a :class:`replay.moved.Moved` (only where an output's shape holds no
batch dimension) and hands each output's place to the loss's op finder.
"""

from __future__ import annotations

from .compat import TorchDispatchMode, tree_leaves
from .load import differentiates_model
from .moved import Moved
from .recorded import samples
from .rerun import Runner
from .run_result import Run
from .source import node_tracebacks


class _Follow(TorchDispatchMode):
    def __init__(self, moved: Moved):
        super().__init__()
        self.moved = moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.moved.track(func.overloadpacket.__name__, args, tree_leaves((args, kwargs)), out)
        return out


def loss_run(runner: Runner, run: Run, mb: int) -> tuple[Run, Moved | None]:
    """The run whose outputs the loss of micro-batch ``mb`` is re-run on: ``run``; a re-run
    keeping the forward's graph with its nodes' lines, for a loss that differentiates the
    model (its autograd.grad needs the graph, which the re-run's backward freed:
    replay.forward_grad); or one whose outputs' places the returned tracker knows, when one
    holds no samples by its shape (a multiple of the batch)."""
    if differentiates_model(runner.step, mb):
        return runner.run(backward=False, instrument=False, forward_ctx=node_tracebacks), None
    s = samples(runner.step, mb)
    outs = run.outputs[mb] if mb < len(run.outputs) else []
    if not (s and s.size > 1) or all(t.dim() == 0 or s.dim(t, stacked=True) is not None
                                     for t in outs):
        return run, None
    moved = Moved(s)
    return runner.run(backward=False, instrument=False, forward_ctx=lambda: _Follow(moved)), moved
