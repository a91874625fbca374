"""The step cycle: a step opens, collects its statistics, and closes with one host read.

A step opens at the first root-module forward after the previous step closed, capturing the RNG
states and the pre-step value of buffers that change. Each module call adds 0-d statistics to
the step's :class:`~recorder.tape.Tape` on the device. The step closes at ``optimizer.step()``
(its pre-hook, so a bad step never updates the weights), or, for loops without an optimizer,
when the backward that wrote its gradients ends (before the loop's own update), else, as for
steps that a ``GradScaler`` skipped, when the next step opens. Closing stacks the statistics
into one row of the ring buffer and reads one small probe back (finiteness of what must be
finite, the NaN check of the rest, the GradScaler's scale; the last update's weight norms ride
in the row): that read is the only host-device sync, and this module is the only one that
makes it. Only when the probe says "non-finite" does the slow path run (:mod:`recorder.alarm`).
Under torch.distributed the ranks' verdicts ride in that same read (one small all-reduce
enqueued before it, :meth:`~recorder.ranks.Agreement.exchange`), so every rank enters the slow
path at the same step.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import NamedTuple

import torch

from .alarm import Alarm
from .anomaly import anomaly_reason
from .buffers import BufferSnapshots
from .compat import scaler_scale, scaler_token, version_of
from .constraints import constraint_detail, constraint_reason
from .errors import NonFiniteError, add_note
from .finite_step_note import finite_step_note
from .foreign import ForeignUpdates
from .grads import output_grad_norms, reread_changed_grads, weight_step_norms
from .hooks import Health
from .linalg import linalg_reason, note_error, raised_inside
from .numeric_check import check_detail, check_reason, raised_in_backward
from .probe import Probe
from .rewind import Rewind
from .ring import RingBuffer, StepLayout
from .rng import RngCapture
from .scalers import raised_by_scaler
from .settings import Settings
from .slots import GRAD, LOOSE, NAN_ONLY, STRICT, Slots
from .tape import Tape
from .target import Target
from .unhooked_call import UNROOTED_WHY, unrooted_reason
from .update_linalg import update_raised

log = logging.getLogger("nanreplay")


class UpdateEvidence(NamedTuple):
    """Squared norms of the weights an update wrote, on the device, taken right after it."""

    step: int  # the step whose update it was
    refs: list  # (parameter index, slot ref)
    slots: Slots


class StepCycle:
    """Opens and closes steps; owns the ring buffer, the slots, the buffer copies and the
    rewind window."""

    def __init__(self, settings: Settings, target: Target, health: Health, alarm: Alarm):
        self.settings, self.target, self.health, self.alarm = settings, target, health, alarm
        self.step = settings.start_step  # index of the step being recorded (or the next)
        self.tape: Tape | None = None
        self.ring = RingBuffer(settings.history)
        self.slots: Slots | None = None
        self.buffers = BufferSnapshots()
        # the copies and step log of FlightRecorder(rewind=N): taken as steps open and close
        self.rewind = Rewind(settings.rewind) if settings.rewind else None
        self.lock = threading.RLock()
        self.updated = False  # an optimizer step ran since the last step opened
        self.ever_updated = False  # the recorded optimizer's step() ran since attach
        # no optimizer: a step with gradients on closed at its backward's end or end_step() (the
        # loop trains by gradient): a forward with gradients off is an evaluation between steps
        self.trains_by_gradient = False
        self.skips = 0  # skipped steps in a row (a GradScaler's, or the loop's own scaler's)
        self.eval_tail: Tape | None = None  # the last evaluation forward, until its loss runs
        self.unrooted_call: int | None = None  # a submodule that ran while no step was open
        self.unrooted_why: str | None = None  # ...and why (unhooked_call.unrooted_reason)
        self.transformed = False  # a root forward ran under a torch.func transform (unrecorded)
        self.traced = False  # a module hook was traced by dynamo (a compiled training step)
        self._unrooted_warned = False
        self.foreign = ForeignUpdates()  # updates by an optimizer the recorder was not given
        self.capture_rng = RngCapture()  # (also as each later micro-batch begins)
        # the last update's evidence, read with the next step's one host read
        self.pending_update: UpdateEvidence | None = None
        self.probe = Probe()  # the step's one host read
        self.copy_targets = False  # the loop wrote into the loss's targets: see Tape.targets_moved

    def release(self) -> None:
        """Let go of the open step, the copies and the evidence (at detach); attached again, no
        update has run since (the loop may have written the weights meanwhile)."""
        self.tape = self.eval_tail = self.slots = self.pending_update = None
        self.updated = self.ever_updated = False
        self.buffers.clear()
        self.foreign.release()
        if self.rewind is not None:
            self.rewind.clear()

    # ------------------------------------------------------------------------------------------
    # opening

    def tape_for_forward(self, evaluating: bool) -> Tape:
        """The tape a root forward records into: the open step's, or a new one (closing first
        a step that ended without an optimizer step). Called under :attr:`lock`."""
        tape = self.tape
        if tape is not None and (tape.evaluation  # one whose forward raised
                                 or self._ended_without_optimizer(tape)):
            self.close_tape(at="forward")
            tape = None
        if tape is None:  # (between steps, an evaluating forward is checked on its own when
            # it returns: a step would hold every such batch and output until the next update)
            tape = self._open_tape(evaluation=evaluating and (
                self.target.has_optimizer or self.trains_by_gradient))
        return tape

    def _ended_without_optimizer(self, tape: Tape) -> bool:
        if not self.target.has_optimizer or self.skipped_by_scaler(tape):
            return True
        return len(tape.micro_batches) >= self.settings.max_micro_batches \
            or self.foreign.moved(tape, self.target.watched)

    def skipped_by_scaler(self, tape: Tape) -> bool:
        """scaler.update() ran since the step opened and optimizer.step() did not (it would
        have closed the step): a step the GradScaler skipped, wherever it gets closed (the
        next forward, or detach when it was the loop's last)."""
        return (self.target.has_optimizer and self.target.has_scaler
                and tape.scaler_token != scaler_token(self.target.scaler()))

    def _open_tape(self, evaluation: bool = False) -> Tape:
        target = self.target
        token = scaler_token(target.scaler()) if target.has_scaler else None
        slots, device = self.slots, target.device()
        if slots is None or slots.device != device:  # first step, or the model moved
            slots = self.slots = Slots(device)
        slots.start_step()
        tape = Tape(self.step, self.capture_rng(), token, slots)
        tape.evaluation = evaluation
        tape.params_from_update = self.updated
        if not evaluation:  # the next training step's weights still come from that update
            self.updated = False
            target.follow_optimizer()
        self.foreign.opened(tape, target.watched)
        if not self.ever_updated and target.has_optimizer and not evaluation:
            # only until the first update (usually one step): the steps' own code may write
            # weights then (a data-dependent init), and no update leaves evidence of them
            tape.finite_at_open = target.finite_flags()
        if target.unowned:  # (none, the usual case: the optimizer holds every one)
            tape.unowned_versions = [version_of(p) for _, p in target.unowned]
        self.buffers.snapshot(training=not evaluation)
        target.attributes.step_started()
        if self.rewind is not None and not evaluation:
            # the copy of step s: before its forward, after the last update and scheduler step
            self.rewind.opened(self.step, target.params, target.buffers, target.optimizer(),
                               target.scheduler(), target.scaler())
        self.tape = tape
        self.unrooted_call = None
        return tape

    def current_step(self) -> int:
        tape = self.tape
        if tape is not None and self.skipped_by_scaler(tape):
            return self.step + 1  # scaler.update() ended it; it is closed at the next forward
        return self.step

    def outside_step(self, idx: int, tape: Tape | None) -> None:
        """A module hook with nothing to record: inactive, or no step open. A submodule called
        while no step is open is remembered for :meth:`unrooted`."""
        if tape is None and idx and self.unrooted_call is None:
            self.unrooted_call = idx
            self.unrooted_why = unrooted_reason(self.target.model())

    def unrooted(self) -> None:
        """An update with no forward of the recorded model since the last one, while one of its
        submodules ran: the loop calls parts of the model (a LightningModule's training_step
        calling ``self.encoder``), so no step ever opens and nothing is checked. Said once."""
        name = self.target.module_names[self.unrooted_call]
        self.unrooted_call = None
        if self._unrooted_warned:
            return
        self._unrooted_warned = True
        if self.unrooted_why is not None:
            log.warning("nanreplay: optimizer.step() ran with no forward of the recorded model "
                        "since the last step: %s", UNROOTED_WHY[self.unrooted_why])
            return
        log.warning("nanreplay: optimizer.step() ran with no forward of the recorded model since "
                    "the last step, while its submodule '%s' ran on its own: nothing is recorded "
                    "or checked. %s", name, self.target.unrooted_advice)

    # ------------------------------------------------------------------------------------------
    # closing

    def closed_by_backward(self, tape: Tape) -> None:
        """The end of a backward that wrote ``tape``'s gradients, given no optimizer (see
        recorder.calls.CallHooks.backward_wrote): the step closes unless another opened since."""
        if self.tape is tape:
            self.close_open_step(at="backward")

    def close_open_step(self, at: str, skipped_by_loop: bool = False) -> None:
        if self.health.active and self.tape is not None:
            if not self.trains_by_gradient and at in ("backward", "end_step") \
                    and not self.tape.evaluation \
                    and any(mb.grad_enabled for mb in self.tape.micro_batches):
                # (not an evolution strategy's end_step() after forwards under no_grad: those
                # forwards are its steps)
                self.trains_by_gradient = True
            self.foreign.moved(self.tape, self.target.watched)  # (as a closing forward does)
            self.close_tape(at=at, skipped_by_loop=skipped_by_loop)

    def close_tape(self, at: str, forced: str | None = None, skipped_by_loop: bool = False) -> None:
        """Check the step with one host read; on an event (or ``forced``), write the bundle."""
        with self.lock:
            tape = self.tape
            if tape is None:
                return
            self.tape = None
            if not tape.evaluation:
                self.step += 1
        try:
            skipped = not tape.evaluation and (skipped_by_loop or self.skipped_by_scaler(tape))
            layout, row, probe, scale = self.build_row(tape, skipped)
        except Exception as e:
            self.health.internal_error(e)
            if at != "exception":
                self.leave_ranks()  # (in place of this step's exchange)
            return
        # (ranks agree on training steps, run in lockstep; one may evaluate alone)
        ok, read_scale = self._read(probe, agree=at not in ("exception", "evaluation"))
        if self.peers_stopped():
            return
        if scale:
            layout.scale = read_scale
        if tape.evaluation:  # the ring is the training steps' history: its row is not kept
            if (not ok or forced) and not self.alarm.fired:  # (a refusal in a rollout too)
                self.alarm.step_event(tape, layout, row, forced if ok else "non_finite")
            return
        self.ring.commit(layout)
        self.copy_targets = self.copy_targets or tape.targets_moved()
        if self.rewind is not None:  # before the event check: the event step is in the window
            self.rewind.closed(tape, self.target.optimizer(), layout.scale, layout.skipped,
                               self.target.params)
        reason = None
        if not ok:
            reason = "non_finite"
        elif self.target.has_scaler or layout.skipped or self.skips:
            self.skips = self.skips + 1 if layout.skipped else 0
            # (or inf: loaded so, or grown past float32's range; never halved back to finite)
            if layout.scale is not None and not self.settings.min_scale <= layout.scale < math.inf:
                reason = "scale_collapse"
            elif self.skips > self.settings.max_skipped_steps:
                reason = "scale_skipping"
        reason = reason or forced
        if reason is not None:  # (a rank that fired already takes part in the others' slow path)
            self.alarm.step_event(tape, layout, row, reason)

    def leave_ranks(self) -> None:
        """At a step's close, where this rank's exchange would run: tell the other ranks when
        an internal error stopped this rank's recorder (see :meth:`Agreement.leave`)."""
        ranks = self.target.ranks
        if ranks is not None and ranks.owes(self.health):
            ranks.leave(self.target.device())

    def peers_stopped(self) -> bool:
        """Another rank's recorder stopped, as the read just made says: this one stops too."""
        ranks = self.target.ranks
        return ranks is not None and ranks.stop_with_peers(self.health)

    def _read(self, probe: torch.Tensor, agree: bool = True) -> tuple[bool, float]:
        """The probe's one host read; under torch.distributed with the ranks' flags folded in
        by one all-reduce: not ok when any rank failed. A step cut short by an exception on
        one rank is checked alone (the others are not in that read, nor in its slow path)."""
        ranks = self.target.ranks
        if ranks is None or not agree:
            if ranks is not None:
                ranks.seen = None  # (so the slow path runs no collective either)
            ok, scale, _ = _read_probe(probe)
            return ok, scale
        ok, scale, values = _read_probe(ranks.exchange(probe))
        any_rank = ranks.read(values)  # (always: it keeps which ranks failed)
        return ok and not any_rank, scale

    def build_row(self, tape: Tape, skipped: bool):
        """Copy the step's statistics into the next ring row and compute, still on the device,
        a probe (see :mod:`recorder.probe`): three device ops, as this runs every step. Returns
        (layout, row, probe, scale): ``row`` is the whole step's (the ring keeps it cut when it
        is wider), ``scale`` whether the probe carries the GradScaler's scale (same read)."""
        target = self.target
        if not tape.evaluation:  # (an evaluation's gradients are the last step's)
            output_grad_norms(tape)
            weight_step_norms(tape, target, self.settings.param_norms)
        layout, pieces, shift, starts, ends = self._layout(tape, skipped)
        total = shift + ends[LOOSE]
        # (a whole-vector row: the slots' length, which the ring follows when they grow)
        row = self.ring.reserve(total, tape.slots.device, grow=not tape.slots.short)
        full = row
        if row.numel() == total and self.ring.device == tape.slots.device:
            torch.cat(pieces, out=row)
        else:  # a row longer than the ring is wide (stored truncated, checked whole), or a
            full = torch.cat(pieces)  # model moved to another device after the first step
            row.copy_(full[: row.numel()])
        # gradient norms of a step the GradScaler skipped are expected to overflow: unchecked
        # (and cleared, so that a later step that writes fewer does not find them)
        if skipped:
            tape.slots.zero(GRAD)
        probe = self.probe.fill(self.ring, full, row, tape.slots.device,
                                shift + ends[STRICT if skipped else GRAD],
                                shift + starts[NAN_ONLY], ends[NAN_ONLY] - starts[NAN_ONLY],
                                scaler_scale(target.scaler()) if target.has_scaler else None)
        return layout, full, probe, self.probe.scaled

    def _layout(self, tape: Tape, skipped: bool):
        """The step's layout, the row's pieces in order, and where the step's regions lie in
        the row: behind the last update's evidence (``shift`` entries), from ``starts`` to
        ``ends`` (see :meth:`Slots.row_pieces`)."""
        opt = self.target.optimizer()
        lrs = [lr if type(lr := g["lr"]) is float else _host_float(lr)
               for g in opt.param_groups] if opt is not None else []
        layout = StepLayout(step=tape.step, lrs=lrs, skipped=skipped,
                            grads_scaled=self.target.has_scaler and not tape.grads_reread)
        slots = tape.slots
        pieces, starts, ends = slots.row_pieces()
        # the last update's evidence goes first, so the probe of the must-be-finite entries checks
        # it too: [update, STRICT, ...]; an evaluation's as well, leaving it to the next step's
        # (weights it left finite that are not now, an EMA swapped in, are not the update's)
        pending = self.pending_update
        if pending is not None and pending.step >= tape.step:
            pending = None  # made after this step closed (another thread's step()): the next's
        updates, shift = [], 0
        if pending is not None:
            self.pending_update = self.pending_update if tape.evaluation else None
            layout.update_step, updates = pending.step, pending.refs
            piece = pending.slots.row_pieces()[0][0]  # (its STRICT region is all it has)
            if pending.slots.device == slots.device:
                pieces = [piece, *pieces]
                shift = piece.numel()
            else:  # the model moved since: that evidence is void
                updates = []
        # Indices into the row are resolved only when a row is decoded (events, export).
        layout.raw = (tuple(tape.calls), tuple(tape.loss), tuple(sorted(tape.grad_norms.items())),
                      tuple(sorted(tape.param_norms.items())), (shift, starts, ends),
                      tuple(updates), tuple(tape.out_grad_norms))
        return layout, pieces, shift, starts, ends

    # ------------------------------------------------------------------------------------------
    # the other closings: an evaluation's loss, an exception, the last update at exit

    def check_evaluation_loss(self, tape: Tape) -> None:
        """The loss of an evaluation forward (already checked and closed): its row again, with
        the loss, and one more host read; the event is then a loss event of that forward."""
        try:
            if not tape.loss:
                return
            layout, row, probe, _ = self.build_row(tape, skipped=False)
            ok, _ = self._read(probe, agree=False)  # the evaluation loss's own host read
        except Exception as e:
            self.health.internal_error(e)
            return
        if not ok and not self.alarm.fired:
            self.alarm.step_event(tape, layout, row, "non_finite")

    def check_on_exception(self, exc: BaseException) -> None:
        """The loop raised ``exc`` while a step was open: the loop's own NaN guard (``if
        loss.isnan(): raise``), ``clip_grad_norm_(..., error_if_nonfinite=True)``, a crash
        mid-forward. Check what the step recorded so far (one host read) and, if it is
        non-finite, write the bundle; ``exc`` goes on, with the recorder's summary added as a
        note. The ``with`` block and the Lightning callback call this; a ``KeyboardInterrupt``
        is left alone."""
        if not isinstance(exc, Exception) or isinstance(exc, NonFiniteError):
            return
        tape = self.tape
        if not self.health.active or self.alarm.fired:
            return
        if tape is None:  # (the pre-hook closed it: raised inside optimizer.step()?)
            return update_raised(self, exc)
        try:
            if not tape.evaluation:  # gradients backward wrote, which no optimizer hook read
                reread_changed_grads(tape, self.target, self.settings.param_norms)
            tape.cut_short = True
            # (the scaler's own error: gradients still scaled, their overflow its to skip)
            self.close_tape(at="exception", forced=_forced(tape, exc, self.target),
                            skipped_by_loop=raised_by_scaler(exc))
        except NonFiniteError as e:
            add_note(exc, str(e))
            return
        except Exception as e:
            self.health.internal_error(e)
            return
        if self.alarm.fired and self.alarm.event is not None:  # warn mode: noted here too
            add_note(exc, self.alarm.summary())
        elif not self.alarm.fired and (note := finite_step_note(exc, self.step - 1, tape)):
            add_note(exc, note)

    def check_last_update(self) -> None:
        """At detach after a clean exit: the last update's evidence (one host read)."""
        pending, self.pending_update = self.pending_update, None
        evidence, ranks = pending and pending.slots.region(STRICT), self.target.ranks
        if pending is None or (self.alarm.fired and ranks is None) or not self.health.active:
            return
        # the detach's one read (with the ranks' flags: every rank stops if one must)
        values = ranks.read_with(evidence) if ranks is not None else evidence.tolist()
        if self.peers_stopped():
            return
        names = self.target.param_names
        bad = [names[i] for i, (_, k) in pending.refs if not math.isfinite(values[k])]
        if bad or (ranks is not None and ranks.seen):
            self.alarm.optimizer_event(bad, step=pending.step, after_update=True)


def _forced(tape: Tape, exc: BaseException, target: Target) -> str | None:
    """The event an exception forces even when the step's statistics are finite: anomaly
    mode's NaN in backward, a decomposition that failed in the model or the loss, a
    distribution's check that refused a value there, or the code's own check on a non-finite
    value (its error kept for the event)."""
    if anomaly_reason(exc):
        return "anomaly"
    reason = linalg_reason(exc) or constraint_reason(exc) or check_reason(exc)
    backward = reason == "check" and raised_in_backward(exc)  # (a gradient's check: a hook's)
    if reason is None or not backward and not raised_inside(
            exc, [*(s.module for s in target.sites), target.loss_module()]):
        return None
    if reason == "linalg":
        note_error(tape, exc, target.loss_module())
    else:
        tape.refused = constraint_detail(exc) if reason == "constraint" else check_detail(exc)
        tape.linalg_phase = "backward" if backward else "forward"  # (the raise's phase)
    return reason


def _read_probe(probe: torch.Tensor) -> tuple[bool, float, list[float]]:
    """The step's one host read: ``probe`` (see :mod:`recorder.probe`), the ranks' flags after
    it under torch.distributed. Returns (all checks pass, scale, what was read)."""
    values = probe.tolist()
    finite, nan_only, _, scale = values[:4]
    return finite == 0.0 and not math.isnan(nan_only), scale, values


def _host_float(x) -> float | torch.Tensor:
    """A group's learning rate for the ring: a float, or for a tensor on a device (a
    capturable, fused or compiled optimizer's lr) a copy of it there, read only when a bundle
    is written (no sync per step; the copy, as a scheduler's ``fill_`` writes the group's
    tensor in place). Left NaN, every update of such a run read as one with a NaN rate."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" else x.detach().clone()
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def close_at_detach(cycle: StepCycle) -> None:
    """Close the step open as the recorder detaches. Forwards after the last update that no
    backward followed, with no loss or in eval mode (a metric taken outside no_grad, a
    validation without it), are checked as an evaluation, not counted as a step nor agreed
    with the other ranks, whose exit reads do not include it. A training forward whose loss
    the loop stopped on (``if not loss.isfinite(): break``) is its step, as is a forward-only
    step of an evolution strategy, which trains by no gradient."""
    tape = cycle.tape
    mbs = tape.micro_batches if tape is not None else ()
    if mbs and cycle.health.active and not tape.grad_norms \
            and (cycle.target.has_optimizer or cycle.trains_by_gradient) \
            and not (tape.loss and any(mb.training for mb in mbs)) \
            and not any(mb.out_grads or mb.differentiated for mb in mbs):
        cycle.foreign.moved(tape, cycle.target.watched)  # (as a closing forward does)
        tape.evaluation = True
        cycle.close_tape(at="evaluation")
    else:
        cycle.close_open_step(at="detach")
