"""The loss op that made an infinity a loss backward node saved.

A censored Weibull likelihood takes ``(k - 1) * log(time)`` for every subject and keeps it
only for the events (``torch.where(event, log_h, 0)``): a censored follow-up time of 0 makes
``log(0) = -inf`` there, which the forward masks and the backward's ``MulBackward0``
multiplies by the where's 0 (NaN). The node saved the -inf; no model op made it, so the node
alone was judged, and a ``mul`` has no pole: 'a value overflowed'. The op is in the loss: the
loss re-run under the op finder names it (``aten.log`` of 0, a pole), its rows and cause.
"""

from __future__ import annotations

from .cause import classify
from .cause_result import Cause
from .held_divisor import loss_buffers
from .hits import OpHit
from .lineage import Lineage
from .load import autocast_as_recorded
from .loss_args import loss_args
from .ops import OpFinder
from .recorded import samples
from .rerun import Runner
from .storages import state_of


def loss_op_finder(runner: Runner) -> OpFinder:
    """An op finder for a re-run of the loss alone: the loss's and the model's state held,
    their parameters named (the loss's trained ones as ``<loss>.NAME``), and the loss's
    buffers (a divisor it keeps: :mod:`replay.held_divisor`)."""
    step = runner.step
    finder = OpFinder(samples=samples(step))
    finder.state = state_of(step.loss_fn, runner.model)
    finder.index_params(runner.model.named_parameters(), loss_buffers(step.loss_fn))
    finder.lineage = Lineage(finder.samples)
    return finder


def made_in_loss(runner: Runner, mb: int, raised: type[BaseException] | tuple = ()
                 ) -> tuple[OpHit, Cause] | None:
    """(op, cause) of the first loss op of micro-batch ``mb`` that made a non-finite value
    from finite inputs; None when none did (or the loss cannot be re-run alone). ``raised``:
    an error the loss is known to end with (a Cholesky given the infinities an op of it made:
    ``LowRankMultivariateNormal``'s capacitance of a 0 ``cov_diag``), after which the op met
    before it still stands."""
    step = runner.step
    if step.loss_fn is None:
        return None
    run = runner.run(backward=False, instrument=False)
    finder = loss_op_finder(runner)
    try:
        args, kwargs = loss_args(step, run, mb, finder)
        with autocast_as_recorded(step.micro_batches[mb], step.device, loss=True), finder:
            step.loss_fn(*args, **kwargs)
    except raised:
        pass
    except Exception:  # (a loss that cannot run on its own: the node alone is judged)
        return None
    hit = finder.first
    if hit is None or hit.intentional or not hit.inputs_finite:
        return None
    return hit, classify(runner, "loss", hit=hit, micro_batch=mb)
