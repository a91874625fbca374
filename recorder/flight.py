"""``FlightRecorder``: the public face of the recorder, a thin facade over its parts.

Each part owns one concept (:mod:`recorder.settings` the settings, :mod:`recorder.target` what
is recorded, :mod:`recorder.calls` the module hooks writing into the step's tape,
:mod:`recorder.cycle` the step cycle and its one host read, :mod:`recorder.guard` the optimizer
hooks, :mod:`recorder.alarm` events and bundles); this module builds them, wires them, and
keeps their hooks' handles.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .alarm import Alarm
from .calls import CallHooks
from .capture import git_commit
from .compat import disabled_scaler
from .compiled import compile_with_hooks
from .cycle import StepCycle, close_at_detach
from .grads import reread_changed_grads
from .guard import OptimizerGuard
from .hooks import Health
from .joined import ddp_in, join_along, refuse_guarded_join
from .lazy_init import AttachWhenInitialized, uninitialized
from .one_per_model import let_go, take_over
from .pause import paused
from .scripted import is_scripted
from .settings import OBJECTS, SETTINGS, Settings, unknown_options
from .snapshot import Sources, build_bundle
from .tape import Tape
from .target import Target
from .unwatched_loss import LossWatch
from .validate import (
    check_companions,
    check_loss_fn,
    check_model,
    check_not_importing,
    has_own_forward,
    torch_optimizer,
)

log = logging.getLogger("nanreplay")


class _CallableLoss(nn.Module):
    """Gives a plain loss function the hooks a loss module has (call it as ``recorder.loss_fn``)."""

    recorded_loss = True  # (recorder.linalg: an error raised inside it is the step's)

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _loss_watch(given, loss_fn: nn.Module | None, calls: CallHooks, integration,
                model) -> LossWatch:
    """What says, once, that the first training step's loss went unwatched."""
    if isinstance(loss_fn, _CallableLoss):
        fn = getattr(given, "func", given)  # (a functools.partial: its function's name)
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        return LossWatch("function", name, bool, integration, model)
    return LossWatch("none" if loss_fn is None else "module", type(given).__name__,
                     partial(getattr, calls, "loss_seen"), integration, model)


class FlightRecorder:
    """Records per-layer statistics every step and writes a bundle at the first NaN/Inf.

    >>> with FlightRecorder(model, optimizer, loss_fn=criterion,    # doctest: +SKIP
    ...                     out_dir="nan-bundles", factory="mypkg.train:make_model"):
    ...     for x, y in loader:
    ...         optimizer.zero_grad()
    ...         loss = criterion(model(x), y)
    ...         loss.backward()
    ...         optimizer.step()   # raises NonFiniteError(bundle_path=...) on the first event

    Args:
        model: the root module; its forward is one micro-batch of a step.
        optimizer: optional; ``optimizer.step()`` closes a step. Without one, a step is one
            root forward, closed when the backward that wrote its gradients ends (before the
            loop's own update), when the next forward begins, at :meth:`end_step` or at
            detach; once a step whose forward ran with gradients on has closed (at its
            backward or :meth:`end_step`), a forward with gradients off is an evaluation
            between steps (a validation batch), not a step.
        loss_fn: optional loss module or callable. A module is hooked in place; a plain
            function must be called through :attr:`loss_fn` to be seen.
        out_dir: where bundles go (created if missing).
        factory: ``"module:function"`` that rebuilds the model, for ``nanreplay``, or that
            function itself (stored as its import path).
        factory_kwargs: keyword arguments (JSON values) the replay passes to ``factory``: the
            run-time configuration (command-line flags, config files) the model was built
            with, which the factory cannot see on its own. Stored in the bundle.
        history: steps kept in the ring buffer.
        on_event: ``"raise"`` (write the bundle, raise :class:`NonFiniteError`) or ``"warn"``
            (write it once, log, keep training).
        strict_inf: what a +-Inf is. False (default): a NaN anywhere is an event, a +-Inf only
            where it matters: in the root module's output, the loss, a gradient, a weight or
            optimizer state, or when it turns into a NaN; one that stays inside the model (an
            additive ``-inf`` mask passed to ``forward``, masked attention scores) is recorded
            in the ring buffer but is no event. True: every +-Inf is an event, in every module
            output and root input, except where ``allow_inf`` says.
        allow_inf: name patterns (fnmatch) of modules whose outputs, buffers whose values and
            root inputs (a keyword argument's name, or ``args[i]``) that may hold +-Inf on
            purpose (masks). NaN is always an event. Mostly for ``strict_inf=True``; by default
            the patterns also exempt the root module's output (pattern ``""``) and tell the
            event finder which infinities are intentional.
        allow_nan: name patterns (fnmatch) of root inputs (a keyword argument's name, or
            ``args[i]``) that may hold NaN on purpose: values missing from tabular data, which
            the model's ``forward`` imputes (``torch.nan_to_num``, ``torch.where(isnan(x), ...)``).
            Their NaN is recorded but is no event by itself; one that gets past the model's
            handling (into a module's output, the loss or a gradient) is an ``input`` event.
        scaler: the ``torch.amp.GradScaler`` in use: steps it skips are not events, but a scale
            below ``min_scale`` (or not finite) or more than ``max_skipped_steps`` skips in a row are.
        lr_scheduler: saved in the bundle when given.
        guard_optimizer: keep a device copy of the weights, gradients and optimizer state
            before each ``optimizer.step()`` and check the weights right after it (a second
            sync), so a bundle can re-run an update that made weights non-finite. Off by
            default; without it such an event is caught at the next step and the bundle holds
            the state after the update.
        stats: ``"minmax"`` (default) records min, max, absmax and NaN/+-Inf flags of every
            call's output (one reduction per call) and every gradient's norm; ``"full"`` adds
            each output's mean and RMS and every parameter's norm (the total parameter norm
            per step), which costs another pass over the weights.
        start_step: the index of the first recorded step (when attaching mid-run).
        rewind: keep the last N to 2N steps replayable: a copy of the weights, buffers,
            optimizer, scheduler and scaler state every ``rewind`` steps (two kept; pinned
            host memory on CUDA, copied without a sync) and each step's micro-batches, RNG
            states and hyper-parameters since the older copy; the bundle holds them and
            ``nanreplay`` re-runs the window (see :mod:`recorder.rewind`). Off (None) by
            default.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 loss_fn=None, out_dir: str | os.PathLike = "nan-bundles",
                 factory: str | Callable[..., Any] | None = None, history: int = 64,
                 on_event: str = "raise", allow_inf: list[str] | tuple[str, ...] = (),
                 scaler=None, lr_scheduler=None,
                 min_scale: float = 1.0, max_skipped_steps: int = 50,
                 guard_optimizer: bool = False, stats: str = "minmax", start_step: int = 0,
                 max_micro_batches: int = 1024, factory_kwargs: dict[str, Any] | None = None,
                 strict_inf: bool = False, rewind: int | None = None,
                 allow_nan: list[str] | tuple[str, ...] = (), **unknown: Any):
        if unknown:  # (Python's own TypeError names the slip, not what was meant)
            raise TypeError(unknown_options("FlightRecorder", sorted(unknown),
                                            [*OBJECTS, *SETTINGS]))
        check_not_importing()  # (nanreplay importing a factory whose module trains)
        optimizer = torch_optimizer(optimizer)  # (a Lightning or accelerate wrapper's inner)
        check_model(model, optimizer, loss_fn)
        check_loss_fn(loss_fn)
        #: the settings, checked (read them as ``recorder.history`` etc. too)
        self.settings = Settings(
            out_dir=out_dir, factory=factory, factory_kwargs=factory_kwargs, history=history,
            on_event=on_event, allow_inf=allow_inf, allow_nan=allow_nan, strict_inf=strict_inf,
            min_scale=min_scale, max_skipped_steps=max_skipped_steps,
            guard_optimizer=guard_optimizer, stats=stats, start_step=start_step,
            max_micro_batches=max_micro_batches, rewind=rewind)
        check_companions(scaler, lr_scheduler)
        if disabled_scaler(scaler):  # nanoGPT's GradScaler(enabled=dtype == float16) in bf16
            scaler = None
        # the training framework a callback records for ("huggingface", "lightning"): the
        # replay's advice names its options
        self.integration: str | None = None
        self.loss_fn = loss_fn if loss_fn is None or isinstance(loss_fn, nn.Module) \
            and not is_scripted(loss_fn) else _CallableLoss(loss_fn)  # (a scripted one: no hooks)
        self.health = Health()
        self.target = Target(model, optimizer, scaler, lr_scheduler, self.settings, loss_fn)
        self.alarm = Alarm(self.settings, self.target, self.health, self._contents, self.detach)
        self.cycle = StepCycle(self.settings, self.target, self.health, self.alarm)
        if self.cycle.rewind is not None:  # (a loss given the model: see micro_batch_entry)
            self.cycle.rewind.modules = self.target.module_ids
            self.cycle.rewind.watch = partial(getattr, self.target, "attributes")
        self.calls = CallHooks(self.target, self.cycle, self.health, self.loss_fn,
                               self.settings.param_norms)
        self.guard = OptimizerGuard(self.target, self.cycle, self.health, self.alarm)
        self.guard.loss_watch = _loss_watch(loss_fn, self.loss_fn, self.calls,
                                            partial(getattr, self, "integration"),
                                            self.target.model)
        self._handles: list = []
        self._ddp = weakref.ref(ddp) if (ddp := ddp_in(model)) is not None else None
        self._attached = False
        self._entered = 0  # the open ``with`` blocks on this recorder
        self._deferred: AttachWhenInitialized | None = None  # (lazy modules: see attach)
        self._commit = git_commit()

    def __getattr__(self, name: str):
        if name in SETTINGS:  # recorder.history, recorder.factory, ...: the settings' fields
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------------------------------
    # public surface

    def __enter__(self) -> FlightRecorder:
        self._entered += 1  # (a block inside its own block: only the outer one detaches)
        try:
            self.attach()
        except BaseException:  # (refused: no block was entered, no __exit__ comes)
            self._entered -= 1
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._entered -= 1
        if self._entered and self._attached:
            return
        try:
            if exc_type is None:
                close_at_detach(self.cycle)
                self.cycle.check_last_update()
                self._said_unused()
            else:
                self.cycle.check_on_exception(exc)
        finally:
            self.detach()

    def _said_unused(self) -> None:
        """A block that ended cleanly with no forward of the model and no update of the
        optimizer: the loop trained another model (one built again per fold or trial after
        the recorder was), and nothing was checked. Said, since no event can come of it."""
        cycle = self.cycle
        if cycle.slots is not None or cycle.ever_updated or cycle.unrooted_call is not None \
                or self.alarm.fired or (model := self.target.model()) is None \
                or not has_own_forward(model):  # (said when it was built)
            return
        opt = self.target.optimizer()
        log.warning("nanreplay: the recorder saw no forward of its model (%s)%s while it was "
                    "attached: nothing was recorded or checked. A model (and optimizer) built "
                    "again after the recorder was, for a fold, a trial or a restart, is not the "
                    "one it records: build the FlightRecorder around the model the loop "
                    "trains, after building it", type(model).__name__,
                    f" and no step of its optimizer ({type(opt).__name__})" if opt else "")

    def attach(self) -> FlightRecorder:
        """Register every hook. Idempotent."""
        if self._attached:
            return self
        target = self.target
        refuse_guarded_join(self._ddp and self._ddp(), self.settings)  # (before any hook)
        # (a notebook cell run again: the old one detached; refused inside another's with)
        take_over(target.model(), self, in_with=self._entered > 0)
        if (model := target.model()) is not None \
                and (names := uninitialized(model, target.optimizer())):
            self._deferred = AttachWhenInitialized(model, target.optimizer(),
                                                   self._attach_initialized, names)
            self._attached = True  # (inactive until then: see recorder.lazy_init)
            return self
        target.bind()
        self.cycle.capture_rng.generators = target.generators
        self.cycle.buffers.bind(target.buffer_homes + target.loss_buffer_homes,
                                target.norm_buffers)
        target.running_stats.began = lambda name: self.cycle.buffers.copies.get(name)
        self._handles += self.calls.register()
        compile_with_hooks(target.model(), target.given())  # (a warm-up ran without them)
        self._handles += join_along(self._ddp and self._ddp(), self)  # (uneven inputs: Join)
        opt = target.optimizer()
        if opt is not None:
            self._handles += self.guard.register(opt)
        if self.cycle.rewind is not None:
            self.cycle.rewind.log_attached(target.params, target.buffers, opt)
        self._attached = self.health.active = True
        return self

    def _attach_initialized(self, steps: int, inside: bool, module, args, kwargs):
        """The lazy parameters have shapes now: attach, and record the forward beginning,
        unless it runs inside an optimizer step that began unhooked (a closure's): that step
        is counted, and recording starts at the next."""
        self._deferred, self._attached = None, False
        self.cycle.step += steps + inside  # (the loop's updates before: its steps)
        self.attach()
        return None if inside else self.calls.root_pre_hook(module, args, kwargs)

    def detach(self) -> None:
        """Remove every hook and drop every reference to the model, optimizer and batches."""
        let_go(self.target.model(), self)
        if self._deferred is not None:
            self._deferred.remove()
            self._deferred = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.cycle.capture_rng.generators = []
        self.cycle.release()
        self.guard.release()
        self.target.release()
        self._attached = self.health.active = False

    def paused(self):
        """``with rec.paused():`` a block whose steps are neither recorded nor counted (a
        learning-rate range test that diverges on purpose and restores the weights): see
        :mod:`recorder.pause`."""
        return paused(self)

    def end_step(self, skipped: bool = False) -> None:
        """Close the current step now: for loops without an optimizer that update by hand, and
        for a loop that skips an update (``optimizer.zero_grad()`` and no ``step()`` when the
        gradient norm is not finite), called before that ``zero_grad()``: the step is then
        checked with its gradients, as ``step()`` would check them. ``skipped=True``: the
        loop's own loss scaler skips this update because the scaled gradients overflowed
        (fairseq's, Megatron's dynamic loss scaling): closed as a step a GradScaler skipped,
        its gradients unchecked, more than ``max_skipped_steps`` such skips in a row an event."""
        tape = self.cycle.tape
        if tape is not None and tape.micro_batches and not tape.evaluation and not skipped \
                and self.target.has_optimizer and self.health.active:
            try:  # (step()'s pre-hook reads them so; without it, no gradient was read)
                reread_changed_grads(tape, self.target, self.settings.param_norms)
            except Exception as e:
                self.health.internal_error(e)
        self.cycle.close_open_step(at="end_step", skipped_by_loop=bool(skipped))

    def record_loss(self, loss) -> None:
        """Check a loss computed outside :attr:`loss_fn` (an inline ``F.cross_entropy`` in a
        Lightning ``training_step``; the Lightning callback calls this) with the open training
        step: a NaN/Inf in it is a ``loss`` event when the step closes, with no extra host
        read. Its inputs are not kept, so the replay re-runs the model but not the loss; a
        ``loss_fn`` it can call names the op. Ignored outside a training step."""
        tape = self.cycle.tape
        if not self.health.active or tape is None or not tape.micro_batches or tape.evaluation:
            return
        try:
            self.calls.loss_recorded = True
            first = len(tape.loss)
            tape.loss_stats(loss)
            # (which of the step's losses were given here: see events._loss_event)
            tape.given_loss = {*tape.given_loss, *range(first, len(tape.loss))}
        except Exception as e:
            self.health.internal_error(e)

    @property
    def event(self) -> dict[str, Any] | None:
        """The event of the bundle written (``None`` until one is)."""
        return self.alarm.event

    @property
    def bundle_path(self) -> Path | None:
        """Where the bundle went (``None`` until one is written)."""
        return self.alarm.bundle_path

    @property
    def step(self) -> int:
        """Index of the step being recorded (or the next one, between steps)."""
        deferred = self._deferred  # (lazy modules: the updates before the attach count)
        return self.cycle.current_step() + (deferred.steps if deferred is not None else 0)

    @property
    def memory_bytes(self) -> dict[str, int]:
        """Memory the recorder holds: on the device, ring buffer, the step's statistics slots,
        buffer copies, optimizer guard; with ``rewind``, the window's bytes on the host
        (``rewind_host``) and on the device (``rewind_device``)."""
        slots, rewind = self.cycle.slots, self.cycle.rewind
        return {"ring": self.cycle.ring.nbytes,
                "statistics": slots.nbytes if slots is not None else 0,
                "buffer_copies": self.cycle.buffers.nbytes,
                "optimizer_guard": self.guard.nbytes,
                **(rewind.nbytes() if rewind is not None else {})}

    def _contents(self, tape: Tape | None, event: dict[str, Any], guard, rank: int,
                  world_size: int):
        """The bundle of ``event`` (see :class:`~recorder.alarm.Alarm`), from the parts."""
        sources = Sources(
            self.settings, self.target, self.cycle.ring, self.cycle.buffers.copies, self.loss_fn,
            self.calls.loss_recorded,
            {"history": self.settings.history, "memory_bytes": self.memory_bytes,
             "guard_optimizer": self.settings.guard_optimizer, "integration": self.integration},
            self._commit, self.cycle.rewind)
        return build_bundle(sources, tape, event, guard=guard, rank=rank, world_size=world_size)
