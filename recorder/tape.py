"""One step's record: per-call references to its statistics (kept in :class:`Slots`), the
micro-batches by reference, and the gradient norms taken before the update.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import partial
from threading import get_ident
from typing import Any

import torch

from .capture import map_tensors, tensor_leaves
from .compat import version_of, view_base
from .slots import STRICT, Slots

_NONE_GIVEN: frozenset[int] = frozenset()


@dataclass(slots=True)
class MicroBatch:
    """One root-module call of the step, kept by reference."""

    args: tuple
    kwargs: dict
    grad_enabled: bool = True
    training: bool = True  # the root's mode (a validation forward in eval mode inside the step)
    # no parameter held a gradient when this later micro-batch began: the loop dropped those
    # of the micro-batches before it (a GAN's zero_grad between its two losses)
    grads_dropped: bool = False
    autocast: dict[str, str] = field(default_factory=dict)  # device type -> dtype
    outputs: Any = None
    loss_args: tuple | None = None
    loss_kwargs: dict | None = None
    # the autocast the loss call ran under (device type -> dtype): the loop's own, which may
    # differ from the forward's (the model under autocast, the loss outside it in float32)
    loss_autocast: dict[str, str] | None = None
    loss_first: int = 0  # where the loss call's statistics begin in Tape.loss
    # the loss calls on this forward's output before the last one (deep supervision in the
    # loop: one call per decoder level), as (args, kwargs, versions, autocast, first); an
    # event in one of them makes it the call kept (select_loss_call)
    earlier_losses: list = field(default_factory=list)
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    # holds True once a backward with create_graph=True went through its output: the loop
    # differentiated the output itself (a gradient penalty, a PINN's residual)
    differentiated: list = field(default_factory=list)
    input_refs: tuple = ()
    input_versions: list = field(default_factory=list)  # (input, version) at the start
    inputs_written: bool = False  # the forward wrote into them: args/kwargs hold what it left
    # the loop wrote into them after the forward returned (a batch that views a dataset's
    # tensor, cleaned in place): args/kwargs hold what the loop left, not what the step ran on
    inputs_changed: bool = False
    # a later forward took its input that requires grad itself (a sampler stepping one tensor
    # in place through .data, which moves no version counter): args/kwargs may hold the last
    # write's values (the later forwards get copies)
    taken_again: bool = False
    # the loss call's tensors that are no model output (its targets), with their versions
    # then; targets_changed: the loop wrote into one since (one label buffer reused for every
    # micro-batch, sy.copy_(y)), so loss_args hold what the loop left, not what the loss took
    loss_versions: list = field(default_factory=list)
    targets_changed: bool = False
    # a later micro-batch's RNG states as it began: the loop may draw between forwards (an RL
    # loop sampling each action), which the step's states, taken as it opened, do not show
    rng: dict[str, Any] | None = None
    # the loop moved the weights in place since the step opened (SAM's ascent to w + e between
    # its forwards, undone before step()): this forward ran on weights the bundle does not hold
    weights_moved: bool = False

    def inputs_moved(self) -> bool:
        """An input was written in place since this micro-batch's forward began."""
        return any(version_of(t) != v for t, v in self.input_versions)

    def written_since(self, leaves) -> bool:
        """Whether the loop wrote into this micro-batch's inputs since (:meth:`inputs_moved`),
        or may have: a later forward's input ``leaves`` hold one of its inputs that require
        grad itself, not a copy (then marked ``taken_again``), as a sampler stepping its one
        tensor in place through ``.data`` between the forwards does, which moves no version
        counter, so the reference would end with the last write."""
        if self.inputs_moved():
            return True
        mine = [t for t, _ in self.input_versions if t.requires_grad]
        if mine and self.loss_args is not None:
            # (not one its loss took: a PINN's points, the same tensor for two forwards, which
            # the loss differentiates by and a copy would cut from the forward's graph)
            took = {id(t) for t in tensor_leaves((self.loss_args, self.loss_kwargs))}
            mine = [t for t in mine if id(t) not in took]
        self.taken_again = bool(mine) and any(u is t for u in leaves for t in mine)
        return self.taken_again

    def keep_copies(self, args, kwargs) -> tuple:
        """Keep copies of the inputs as they came (a forward, or the loop, writes into them),
        and return them, to be measured in their place: a tensor an earlier forward took,
        stepped since through ``.data`` (no version moves), would find that forward's
        statistics in the cache, as if unchanged."""
        self.args, self.kwargs = map_tensors(args, _copy), map_tensors(kwargs, _copy)
        return self.args, self.kwargs

    def keep_loss_call(self, args, kwargs, cache: dict, copy: bool, first: int = 0,
                       autocast: dict[str, str] | None = None) -> None:
        """Keep the loss call's arguments: by reference, with the versions of those that are
        no model output nor input (``cache``: this step's; those are its targets), or, once the
        loop was seen writing into one (``copy``: ``StepCycle.copy_targets``), with copies of
        the targets. ``first``: where its statistics begin in ``Tape.loss``; ``autocast``: the
        autocast it ran under. A call before it on this micro-batch is kept aside."""
        if self.loss_args is not None:
            self.earlier_losses.append(self._loss_call())
        if copy and self.grad_enabled:
            args, kwargs = map_tensors(args, partial(_copy_target, cache)), \
                map_tensors(kwargs, partial(_copy_target, cache))
            self.loss_versions = []
        else:  # (the usual ``crit(out, y)``: tensors only, looked at without a walk)
            leaves = args if not kwargs and _TENSOR.issuperset(map(type, args)) \
                else tensor_leaves((args, kwargs))
            self.loss_versions = [(t, version_of(t)) for t in leaves
                                  if not t.requires_grad and id(t) not in cache]
        self.loss_args, self.loss_kwargs = args, kwargs
        self.loss_first, self.loss_autocast = first, autocast

    def _loss_call(self) -> tuple:
        return (self.loss_args, self.loss_kwargs, self.loss_versions, self.loss_autocast,
                self.loss_first)

    def select_loss_call(self, k: int) -> None:
        """Keep, as the micro-batch's loss call, the one whose statistics hold ``Tape.loss[k]``
        (the first non-finite loss): the bundle then holds the arguments it took."""
        calls = [*self.earlier_losses, self._loss_call()]
        chosen = next(c for c in reversed(calls) if c[4] <= k)
        self.loss_args, self.loss_kwargs, self.loss_versions, self.loss_autocast, \
            self.loss_first = chosen

    def select_loss_call_of(self, bad: set[int]) -> None:
        """Keep, as the micro-batch's loss call, the first that took one of the root outputs
        ``bad`` (their indices among its tensors) whose gradient went bad: that call's
        backward made it (a deep-supervision level's). A call took an output as it is or a
        view of it; when none did (a copy, ``out.float()``), the last call stays."""
        if not self.earlier_losses:
            return
        outs = [o for i, o in enumerate(tensor_leaves(self.outputs)) if i in bad]
        for call in [*self.earlier_losses, self._loss_call()]:
            if any(t is o or view_base(t) is o for t in tensor_leaves([list(call[0]), call[1]])
                   for o in outs):
                self.loss_args, self.loss_kwargs, self.loss_versions, self.loss_autocast, \
                    self.loss_first = call
                return

    def targets_moved(self) -> bool:
        """A tensor the loss took besides the model's output was written in place since."""
        for t, v in self.loss_versions:  # (no generator: this runs for every step)
            if version_of(t) != v:
                return True
        for call in self.earlier_losses:  # (empty but in a loop that calls the loss again)
            for t, v in call[2]:
                if version_of(t) != v:
                    return True
        return False


_TENSOR = frozenset((torch.Tensor,))


def _copy_target(cache: dict, t: torch.Tensor) -> torch.Tensor:
    """A copy of a loss argument that is no model output nor input (those the replay makes
    or holds as such): a target, which the loop may write over before the step closes."""
    return t if t.requires_grad or id(t) in cache else t.clone()


class Tape:
    """Everything recorded during one step (all micro-batches)."""

    # (slots: one compact object, made at every step and read by every hook)
    __slots__ = ("step", "slots", "rng", "scaler_token", "calls", "micro_batches", "last", "loss",
                 "given_loss", "cache", "lock", "params_from_update", "finite_at_open",
                 "grad_norms", "param_norms", "grad_seen", "out_grad_norms", "grads_reread",
                 "evaluation", "cut_short", "unowned_versions", "held_version",
                 "updated_elsewhere", "by_thread", "_first_thread", "linalg_error", "linalg_phase",
                 "refused", "close_queued", "transformed")

    def __init__(self, step: int, rng: dict[str, Any], scaler_token: int | None, slots: Slots):
        self.step = step
        self.slots = slots  # where this step's statistics are computed
        self.rng = rng
        self.scaler_token = scaler_token
        # (module index, micro-batch, completion order, outs, stats, ins)
        self.calls: list[tuple] = []
        self.micro_batches: list[MicroBatch] = []
        self.last = -1  # the last micro-batch begun (what ``micro_batch`` says on one thread)
        self.loss: list[tuple[int, tuple, tuple]] = []
        # indices of ``loss`` given to record_loss (a set made by the first: most steps have none)
        self.given_loss: frozenset[int] | set[int] = _NONE_GIVEN
        # id(tensor) -> (weakref, min ref, max ref, intended, version): outputs seen this step,
        # so a module whose input is an earlier output costs no extra reduction; intended: an
        # allow_inf module's output (or input, buffer), whose +-Inf a later input may hold.
        self.cache: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.params_from_update = False  # an optimizer step ran since the previous step
        # per parameter, finite when a step before the optimizer's first update opened (a
        # device tensor, read only on an event; see Target.written_in_step)
        self.finite_at_open: torch.Tensor | None = None
        # parameter index -> slot ref of its squared gradient / weight norm
        self.grad_norms: dict[int, tuple[int, int]] = {}
        self.param_norms: dict[int, tuple[int, int]] = {}
        self.grad_seen: dict[int, tuple[int, int]] = {}  # (id, version) of the gradient read
        # (micro-batch, output index, slot ref of its squared norm): the gradient backward
        # brought to each root output, checked like the parameters' (recorder.grads)
        self.out_grad_norms: list[tuple[int, int, tuple[int, int]]] = []
        # norms read before the update from unscaled gradients (else divided by the scale)
        self.grads_reread = False
        self.evaluation = False  # an evaluation forward between steps, not a training step
        self.cut_short = False  # closed by the loop's exception, maybe before its loss ran
        # versions, at the step's start, of the trained parameters the optimizer does not hold
        self.unowned_versions: list[int | None] = []
        # version, at the step's start, of one weight the optimizer holds (Target.watched)
        self.held_version: int | None = None
        self.updated_elsewhere = False  # it did change: another optimizer stepped in the step
        self.close_queued = False  # no optimizer: closes when the backward writing grads ends
        self.transformed = False  # its forwards ran under torch.func transforms only (unrecorded)
        # thread id -> the micro-batch its forward is in, once a second thread runs forwards
        # in the step (a hook's micro-batch is then its thread's, not the last one begun)
        self.by_thread: dict[int, int] | None = None
        self._first_thread: int | None = None
        # what an exception that closed the step said: a decomposition's error (see
        # recorder.linalg), a distribution's refused value (recorder.constraints)
        self.linalg_error: str | None = None
        self.linalg_phase = "forward"  # (or "loss", or "backward": raised by a derivative)
        self.refused: str | None = None

    def targets_moved(self) -> bool:
        """The loop wrote into a loss's targets after the loss took them (seen as the next
        micro-batch begins and as the step closes: one label buffer reused for every
        micro-batch, ``sy.copy_(y)``; a memory bank updated before ``step()``): from then on
        the recorder keeps copies of them (``StepCycle.copy_targets``)."""
        for mb in self.micro_batches:  # (MicroBatch.targets_moved inlined: every step runs it)
            for t, v in mb.loss_versions:
                if version_of(t) != v:
                    return True
        return False

    def loss_stats(self, output) -> None:
        """The (min, max) of each floating tensor of a loss call's ``output`` among the step's
        must-be-finite statistics."""
        for t in (output,) if type(output) is torch.Tensor else tensor_leaves(output):
            if t.is_floating_point() and t.numel():
                lo, hi = self.slots.minmax(t.detach(), STRICT)
                self.loss.append((self.micro_batch, lo, hi))

    def add_micro_batch(self, mb: MicroBatch, watched: torch.Tensor | None = None) -> None:
        """Begin the calling thread's next micro-batch (under the step cycle's lock);
        ``watched``: the weight whose version says the loop moved the weights since the step
        opened (``Target.watched``)."""
        ident, n = get_ident(), len(self.micro_batches)
        if n and watched is not None and self.held_version is not None:
            mb.weights_moved = version_of(watched) != self.held_version
        if self.by_thread is None:
            if not n:
                self._first_thread = ident
            elif ident != self._first_thread:
                self.by_thread = {self._first_thread: n - 1}
        if self.by_thread is not None:  # (set before the append: see micro_batch)
            self.by_thread[ident] = n
        self.micro_batches.append(mb)
        self.last = n

    @property
    def micro_batch(self) -> int:
        """The calling thread's micro-batch: the last one begun while one thread runs them."""
        n = len(self.micro_batches)  # (read before by_thread, which is set before an append)
        by_thread = self.by_thread
        return n - 1 if by_thread is None else by_thread.get(get_ident(), n - 1)


def fed_to(micro_batches: list[MicroBatch], i: int) -> int | None:
    """The first micro-batch after ``i`` that took micro-batch ``i``'s output, the very tensor,
    as an input (an autoregressive rollout's next lead time), or None."""
    outs = {id(t) for t in tensor_leaves(micro_batches[i].outputs)}
    return next((j for j, m in enumerate(micro_batches) if j > i and any(
        id(t) in outs for t in tensor_leaves([list(m.args), m.kwargs]))), None)


def _copy(t: torch.Tensor) -> torch.Tensor:
    c = t.detach().clone()  # (one the loop differentiates by still requires grad in the replay)
    return c.requires_grad_() if t.requires_grad and c.is_floating_point() else c
