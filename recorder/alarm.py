"""The slow path: a check failed, so find the event, write the bundle, raise or warn. Once.

Runs after the step's single host read said something is not finite (or the GradScaler's
checks tripped), so it may read whatever it needs from the device. Under torch.distributed
every rank is here at the same step (the read carried the ranks' verdicts): each finds its own
event, then :meth:`~recorder.ranks.Agreement.settle` tells them all which rank saw it first
(a rank whose own values were finite writes a ``peer`` event), and each writes its own bundle.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import bundle, event_text, events, ranks
from .abandoned import clear_abandoned
from .capture import distributed_rank
from .compiled import compiled_loss
from .errors import NonFiniteError, first_line
from .events import Event
from .factory_home import run_there
from .factory_needed import factory_advice
from .finite import tensors_kind
from .holders import holders_of
from .hooks import Health
from .kept_targets import settle_targets
from .late_writes import moved_in_step
from .loss_forwards import ran_in_loss
from .notebook import replay_advice
from .partial_writes import spare_futile
from .pre_update import written_before_update_event
from .received_input import received_input
from .replaced import swapped_in_event
from .rewind import rename_window
from .ring import StepLayout
from .running_stats import statistic_event
from .scalers import not_given as scaler_not_given
from .scalers import scaler_left_open
from .settings import Settings
from .shards import local
from .skipped_batch import skipped_note
from .slots import GRAD
from .stale_grads import held_first, unused_grads
from .state_check import non_finite_state, state_detail
from .step_evidence import StepEvidence
from .tape import Tape
from .target import Target
from .target_inputs import forward_names
from .tied import aliases_of
from .user_hooks import rewriting_pre_hooks
from .validate import why_unwritable, write_remedy

log = logging.getLogger("nanreplay")

# (tape or None, event, optimizer guard's copies or None, rank, world size) -> (meta, tensors)
Contents = Callable[[Tape | None, dict[str, Any], Any, int, int],
                    tuple[dict[str, Any], dict[str, torch.Tensor]]]


class Alarm:
    """The first event of a recorder, its bundle and its message."""

    def __init__(self, settings: Settings, target: Target, health: Health, contents: Contents,
                 stop: Callable[[], None] = lambda: None):
        self.settings, self.target, self.health = settings, target, health
        self._contents = contents
        # the recorder's detach, at a raised event: its hooks would only cost the loop's calls
        # from then on (a loop that catches NonFiniteError and trains on, a recorder attached
        # without a with block), and it records nothing more
        self._stop = stop
        self._fired = False
        self._stopped = False  # this alarm's raise detached the recorder (see fired)
        self.event: dict[str, Any] | None = None
        self.renamed: dict[str, str] = {}  # parameters renamed since attach (Target.rename)
        self.bundle_path: Path | None = None
        self._lock = threading.RLock()
        self.state_check = False  # the next update checks the state it wrote (state_check)

    @property
    def fired(self) -> bool:
        """Whether the event is taken. A raised event detaches the recorder; ``attach()``
        again (a loop that catches NonFiniteError, skips the batch and trains on) makes it
        active again, which re-arms it: the next event writes its own bundle and raises too,
        rather than training on silently with the hooks on. (Not under torch.distributed,
        where the ranks agree on one event.)"""
        if self._stopped and self.health.active and self.target.ranks is None:
            self._fired = self._stopped = False
        return self._fired

    @fired.setter
    def fired(self, value: bool) -> None:
        self._fired, self._stopped = value, False

    def _claim(self) -> bool:
        with self._lock:
            if self.fired:
                return False
            self.fired = True
            return True

    def step_event(self, tape: Tape, layout: StepLayout, row: torch.Tensor, reason: str) -> None:
        """A step whose probe failed: find its first offender and report it."""
        if not self._claim():
            self._take_part(tape.step)
            return
        target = self.target
        self.renamed = target.rename()
        _mark_changed_inputs(tape)
        try:
            values = row.tolist()
            # (the statistics of a forward that raised, which the loop caught: see abandoned)
            handled = reason == "non_finite" and clear_abandoned(tape, layout, values)
            evidence = StepEvidence(
                values, layout, tape, target.module_names, target.module_types,
                target.param_names, [p for _, p in target.params], target.allowed_modules,
                strict_inf=self.settings.strict_inf, params_from_update=tape.params_from_update,
                changed=set(target.changed_in_step(tape)) | set(target.written_in_step(tape)),
                seq_first=target.seq_first, recurrent=target.recurrent,
                arg_names=forward_names(target.model()),
                constants=target.constants, stale=unused_grads(target),
                rewritten=rewriting_pre_hooks([(s.name, s.module) for s in target.sites]),
                # (no optimizer: the loop's own update may have run, unless the step closed
                # as its backward ended, recorder.calls.CallHooks.backward_wrote)
                weights_moved=not target.has_optimizer and not tape.close_queued
                or moved_in_step(tape, target.watched))
            event = None if handled else events.find_event(evidence, reason)
            if event is None or event.detail == events.UNIDENTIFIED:  # (only a statistic)
                event = statistic_event(evidence, target.running_stats) or event
            settle_targets(tape.micro_batches)  # (each micro-batch's kept loss call chosen)
            if event is not None and event.phase == "optimizer":  # (or the loop's swap-in)
                event = swapped_in_event(event.step, event.params, target.replaced_bad) or event
            if event is not None and event.phase == "backward" and event.params:
                held_first(event, target)
        except Exception as e:  # a bug of ours must not lose the step the probe found bad
            evidence, event = None, _unfound(tape.step, reason, e)
        agreement = target.ranks
        if agreement is not None and agreement.seen is not None:  # every rank is here
            event = _settled(agreement, event, tape, evidence)
        elif agreement is not None and event is not None:  # a cut-short step: this rank alone
            event.ranks = agreement.alone()
        if event is None:  # false alarm: norms of huge but finite tensors overflowed
            # Their +inf stays in the slots, whose whole vector later rows copy: a row that
            # writes no gradient norm (an evaluation forward's; GradCache's no-grad pass before
            # its loss) would fail on it and find nothing. This row is in the ring already.
            tape.slots.zero(GRAD)
            with self._lock:
                self.fired = False
            # (Adam's square of such a gradient: the update's state, checked after it; not
            # under torch.distributed, where the ranks agree on events in the step's read)
            self.state_check = target.has_optimizer and not tape.evaluation \
                and target.ranks is None
            return
        if tape.evaluation:
            event.evaluation = True
            if any(mb.grad_enabled for mb in tape.micro_batches):
                event.no_backward = True  # (see StepCycle.close_open_step)
        if event.module in target.compiled or (event.module == "<loss>"
                                               and compiled_loss(target.loss_module())):
            event.compiled = True  # its layers were not recorded (see recorder.compiled)
        self._write_and_report(tape, event)

    def optimizer_event(self, bad: list[str], step: int, after_update: bool,
                        tape: Tape | None = None, guard=None) -> None:
        """An update whose weights ``bad`` had non-finite norms right after it."""
        self.renamed = self.target.rename()
        names = {self.renamed.get(n, n) for n in bad}
        # norms overflow float32 for finite values above ~1.8e19: the weights decide
        pairs = [(n, local(p)) for n, p in self.target.params
                 if n in names and not bool(torch.isfinite(local(p)).all())]
        agreement = self.target.ranks
        agreed = agreement is not None and agreement.seen is not None  # every rank is here
        if not pairs and not agreed:
            return
        if not self._claim():
            self._take_part(step)
            return
        event = swapped_in_event(step, [n for n, _ in pairs], self.target.replaced_bad) \
            or written_before_update_event(step, [n for n, _ in pairs], guard, self.renamed) \
            or (events.optimizer_event(step, [n for n, _ in pairs], after_update=after_update,
                                       kind=tensors_kind(p for _, p in pairs) or "nan"
                                       ) if pairs else None)
        if agreed:
            event = agreement.settle(event, step)
        if event is None:  # no rank's weights are non-finite (norms of huge values overflowed)
            with self._lock:
                self.fired = False
            return
        if after_update:  # the weights are those the update left; no step's batch with them
            self._write_and_report(None, event)
        else:
            self._write_and_report(tape, event, guard=guard)

    def update_linalg_event(self, tape: Tape | None, event: Event, guard) -> None:
        """A decomposition that failed inside ``optimizer.step()`` (recorder.update_linalg):
        its bundle, from the guard's copies before the update when kept."""
        if not self._claim():
            self._take_part(event.step)
            return
        self.renamed = self.target.rename()
        self._write_and_report(tape, event, guard=guard)

    def state_event(self, optimizer, step: int) -> None:
        """The update of ``step`` after one whose norms overflowed: its optimizer state, read
        now (see recorder.state_check); a non-finite entry is an ``optimizer`` event."""
        self.state_check = False
        bad, kind = non_finite_state(optimizer, {id(p): n for n, p in self.target.params})
        if not bad or not self._claim():
            return
        self.renamed = self.target.rename()
        event = events.optimizer_event(step, list(bad), after_update=True, kind=kind)
        event.state, event.detail = bad, state_detail(bad)
        self._write_and_report(None, event)

    def _take_part(self, step: int) -> None:
        """A rank that already reported its own event (an evaluation's, which the ranks do not
        agree on) still takes part in the slow path's all-reduce the others run."""
        agreement = self.target.ranks
        if agreement is not None and agreement.seen is not None:
            agreement.settle(None, step)

    def summary(self) -> str:
        return _message(self.event, self.bundle_path, self.settings.on_event == "raise")

    def _wrote(self, as_dict: dict[str, Any]) -> None:
        """Before raising: the ranks' bundles of the step are on disk (:meth:`Agreement.wrote`)."""
        if (agreement := self.target.ranks) is not None:
            try:
                agreement.wrote(as_dict.get("ranks"), as_dict["step"])
            except Exception as e:  # (the store gone: raise all the same)
                log.warning("nanreplay: could not tell the other ranks this rank's bundle is "
                            "written (%s)", first_line(e, 200))

    def _raise_stopped(self, as_dict: dict[str, Any]) -> None:
        """Before raising: stop recording (detach), to be re-armed by an attach (see fired)."""
        self.health.active = False
        self._wrote(as_dict)
        self._stop()
        self._stopped = True

    def _write_and_report(self, tape: Tape | None, event: Event, guard=None) -> None:
        if event.after_update and event.step < self.settings.start_step:
            # an update whose optimizer.step() closed no step (no forward of the recorded model
            # ran before it, only its submodules: a training method other than forward, SB3's
            # evaluate_actions): numbered "the step before" the first, which never existed
            event.step, event.no_step_closed = self.settings.start_step, True
        self.event = as_dict = event.as_dict()
        rank, world = distributed_rank()
        raising = self.settings.on_event == "raise"
        out_dir = self.settings.out_dir
        try:
            meta, tensors = self._contents(tape, as_dict, _renamed(guard, self.renamed), rank,
                                           world)
            if ran_in_loss(meta.get("micro_batches") or [], meta.get("loss"),
                           as_dict.get("micro_batch")):  # (the loss called the model itself)
                as_dict["forward_in_loss"] = True  # (meta's event: the bundle says so too)
            if not self.target.has_scaler and (said := scaler_left_open(
                    event.phase, event.step, event.micro_batch)):
                meta["scaler_not_given"] = said
            if "loss" not in meta and (held := _held_by(self.target)):
                meta["model_held_by"] = held  # (a loss wrapper computed the loss: see replay)
            if as_dict.get("params") and (tied := _tied_to(as_dict["params"], meta)):
                as_dict["tied"] = tied  # (the message and the bundle name the other names)
            if self.renamed:  # (the replay says so: the factory's model may predate it)
                meta["renamed_after_attach"] = self.renamed
                rename_window(meta, tensors, self.renamed)
            path, moved = _write(out_dir, f"step{event.step:08d}-rank{rank}", meta, tensors)
        except Exception as e:
            why = (why_unwritable(out_dir, e) + _failed_where(out_dir, e)
                   if isinstance(e, OSError)
                   else f"{type(e).__name__}: {first_line(e, 300)}")  # (a CUDA error: 3 lines)
            msg = _message(as_dict, None, raising) + f" Writing the bundle failed: {why}"
            if raising:
                self._raise_stopped(as_dict)
                raise NonFiniteError(msg, event=as_dict, write_error=e) from e
            log.warning(msg)
            return
        self.bundle_path = path
        msg = _message(as_dict, path, raising)
        if (model := self.target.model()) is not None:  # (a class a notebook cell defined)
            msg = factory_advice(replay_advice(msg, path, meta, type(model)), path, meta,
                                 type(model))
        msg = run_there(msg, path, meta)  # (the factory's module imported from elsewhere)
        if tape is not None and not tape.evaluation and not tape.cut_short:
            msg += _loss_not_called(meta)  # (else the loss may simply not have run yet)
            msg += skipped_note(tape, as_dict.get("micro_batch"))
        if meta.get("scaler_not_given"):
            msg += " " + scaler_not_given(meta)
        if moved is not None:
            msg += (f" out_dir '{out_dir}' could not be written ({why_unwritable(out_dir, moved)})"
                    ", so the bundle went to a new temporary directory: move it somewhere safe "
                    "and give the recorder an out_dir it can write.")
        if raising:
            self._raise_stopped(as_dict)
            raise NonFiniteError(msg, bundle_path=path, event=as_dict, write_error=moved)
        log.warning(msg)


def _tied_to(params: list[str], meta: dict[str, Any]) -> dict[str, list[str]]:
    """``{name: [its other names]}`` of the event's parameters that are one tensor reached
    under several names (``lm_head.weight = tok_emb.weight``): the event names the first."""
    tied = meta.get("tied_params") or {}
    return {p: others for p in params if (others := aliases_of(tied, p))}


def _renamed(guard: dict[str, Any] | None, renamed: dict[str, str]) -> dict[str, Any] | None:
    """The optimizer guard's copies under the parameters' names now (:meth:`Target.rename`)."""
    if not guard or not renamed:
        return guard
    return {k: ({renamed.get(n, n): v for n, v in c.items()}
                if k in ("weights", "grads", "state") else c) for k, c in guard.items()}


def _failed_where(out_dir: Path, e: OSError) -> str:
    """Where the bundle could not be written: out_dir and a new temporary directory (a disk
    full for both), or out_dir alone where a second copy could not have succeeded."""
    if (futile := spare_futile(out_dir, e)) is not None:
        return (f" (in out_dir '{out_dir}'; not written again in the temporary directory: "
                f"{futile}); {write_remedy(e)}.")
    return f" (in out_dir '{out_dir}' and in a new temporary directory); {write_remedy(e)}."


def _write(out_dir: Path, stem: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
           ) -> tuple[Path, OSError | None]:
    """The bundle written to ``out_dir`` or, when that fails (its disk full, a file put in its
    place or its permissions changed since the recorder checked it), to a new private
    directory under the system's temporary directory: the only record of a run that may have
    trained for days is not lost to its out_dir. Returns the path and out_dir's error (None
    when out_dir took it); raises out_dir's error when neither could be written."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        return bundle.write_bundle(out_dir, stem, meta, tensors), None
    except OSError as e:
        refused = e
    if spare_futile(out_dir, refused) is not None:  # (a second full write, bound to fail)
        raise refused
    try:
        spare = Path(tempfile.mkdtemp(prefix="nan-bundles-"))  # mode 0700: it holds the batch
    except OSError:
        raise refused from None
    try:
        return bundle.write_bundle(spare, stem, meta, tensors), refused
    except OSError:
        shutil.rmtree(spare, ignore_errors=True)
        raise refused from None


def _loss_not_called(meta: dict[str, Any]) -> str:
    """A plain function given as loss_fn that the step never called through ``rec.loss_fn``
    (called directly, it is neither checked nor replayable): say so where the user reads."""
    mbs = meta.get("micro_batches") or []
    if (meta.get("loss") or {}).get("kind") != "function" or not mbs \
            or any(mb.get("loss_inputs") for mb in mbs):
        return ""
    return (" The loss function given as loss_fn was not called through rec.loss_fn in this "
            "step, so it was neither checked nor recorded: call loss = rec.loss_fn(...).")


def _mark_changed_inputs(tape: Tape) -> None:
    """Micro-batches whose inputs the loop wrote into after their forward returned (a batch
    whose tensors view a dataset's, which the loop cleans in place before ``step()``): the
    bundle would hold them as the loop left them, not as the step ran on them; likewise the
    loss's targets written after the loss took them (a reused label buffer). (Only at an
    event: the version counters cost nothing to read, but the healthy steps need none.)"""
    for mb in tape.micro_batches:
        if not mb.inputs_written and mb.inputs_moved():
            mb.inputs_changed = True
        mb.targets_changed = mb.targets_moved()


def _settled(agreement, event: Event | None, tape: Tape, evidence) -> Event | None:
    """``event`` as the ranks agreed on it (see ``recorder.ranks.Agreement.settle``)."""
    return agreement.settle(event, tape.step, own_backward=evidence is not None
                            and events.output_grad_bad(evidence),
                            order=ranks.completion_order(evidence, event),
                            received=received_input(tape, event))


def _unfound(step: int, reason: str, e: Exception) -> Event:
    """The event of a step the probe found non-finite where finding its first offender failed
    (the recorder's own error): the bundle is still written, and the replay re-runs the step."""
    first = first_line(e, 200)
    log.warning("nanreplay: finding the first non-finite value of step %d failed (%s: %s); the "
                "bundle is written without it", step, type(e).__name__, first)
    return Event(step, reason=reason, detail=f"the recorder's search failed ({type(e).__name__}:"
                 f" {first}); nanreplay re-runs the step")


def _held_by(target: Target) -> list[dict[str, str]]:
    """The modules holding the model (:func:`holders_of`); none when looking fails, which
    must not cost the bundle."""
    try:
        return holders_of(target.model(), target.given())
    except Exception:
        return []


def _message(event: dict[str, Any], path: Path | None, stopped: bool = True) -> str:
    """The event's one paragraph, with who saw it first under torch.distributed (and whether
    the ranks stopped: ``on_event="warn"`` trains on)."""
    return ranks.summary(event, path, event_text.summary(event, path), stopped)
