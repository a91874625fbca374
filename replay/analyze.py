"""From a rebuilt step to the report: reproduce, localise, name the op, classify the cause.

>>> step = read_step("nan-bundles/step00000006-rank0.nan")     # doctest: +SKIP
>>> build(step, factory=None, device=None)
>>> report = analyze(step)
>>> report["origin"]["module"], report["origin"]["op"], report["cause"]
('encoder.2.act', 'aten.log', 'invalid')

The bundle may decide alone (:mod:`replay.recorded`); else two re-runs must agree and match the
recording (:mod:`replay.fidelity`), and the phase that made the first non-finite value is
localised (:mod:`replay.forward`, :mod:`replay.origins`); then a rewind window
(:mod:`replay.window_report`) and the what-ifs (:mod:`replay.whatif`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recorder.eval_with_grad import bundle_note as eval_with_grad
from recorder.loss_forwards import ran_in_loss
from recorder.scalers import not_given as scaler_not_given

from . import fidelity, module_hooks, tied_names, written_notes
from .backward_report import report_backward, report_dropped_nan, report_loss_backward
from .before_update import nan_before_update
from .cast_overflow import data_hint
from .class_kept import put_back_classes
from .comm_hook import cast_overflowed, made_on_rank
from .data_hints import data_hints
from .decay_divergence import update_rule_hints
from .derived_input import derived_input_hint
from .diverging_hint import diverging_hint
from .diverging_op import rounding_only
from .edited_rerun import edited_not_reproduced
from .eps_checked import checked_eps
from .errors import FactoryRefused
from .failed_stage import Known, kept_going, survived
from .fed_back import report_fed_back
from .findings import base_report, finish, origin_fields, recorded_origin
from .forward import report_forward
from .given_loss import report_given_loss
from .handled_loss import handled_notes
from .hidden import report_hidden_forward
from .imputed import RERUN, made_from_imputed
from .input_grad import made_by_input_gradient
from .kept_outside import note_outside_state
from .kept_report import report_graph_args, report_kept_aside
from .load import Step, read_step, run_switches
from .local_shards import unsharded_hint
from .loop_grads import finite_gradients_reached_the_output as _finite_gradients_reached_the_output
from .loop_grads import gradients_from_the_loop as _gradients_from_the_loop
from .loop_grads import no_backward_reached_the_output as _no_backward_reached_the_output
from .loop_written import report_loop_written
from .loss_grad import loop_differentiation, not_rerun_term
from .loss_own import settle_loss_started
from .masked_targets import masked_loss_hint
from .moved_weights import report_moved_weights
from .negative_lr import below_zero
from .optimizer_origin import after_update_hint, mark_update_not_rerun, report_optimizer
from .origins import (
    infinity_the_loss_took,
    report_entering,
    report_loss,
    report_loss_not_in_bundle,
    report_weights,
)
from .outside import unrebuilt_loss
from .overflowed_statistics import statistic_came_in, statistics_note, written_statistic_note
from .param_writes import number_note
from .pre_update import written_before_update
from .raised_note import raised_note
from .rebuild import build
from .recorded import (
    batch_non_finite,
    batch_size,
    input_origin,
    non_finite_weights,
    scale_of_the_step,
    stepped_after_forward,
)
from .recurrence import add_iterates_note
from .refused import report_raised
from .relu_recurrence import relu_recurrence_hint
from .rerun import Runner
from .second_order import adapted_from_gradient, report_made_weights, report_second_order
from .shards import shard_set
from .source import distributed_call
from .state import forward_written, state_notes
from .state_overflow import state_report
from .switches import flushed_note
from .target_input import target_input_hint
from .trained_input import trained_input_hint
from .unrecorded_steps import report_unrecorded
from .unset_state import unset_state_or_raise
from .unwritten_rerun import disagreeing, note_unwritten
from .update_linalg import report_update_linalg
from .update_params import others_note, update_params
from .whatif import run_tries
from .window_report import add_window
from .written_forward import report_written_forward

__all__ = ["analyze", "analyze_bundle", "scale_of_the_step"]


def analyze(step: Step, tries: Sequence[str] = ()) -> dict[str, Any]:
    """The report for one built bundle; with a rewind window, its re-run (an optimizer event
    replayable); ``tries``: the ``--try`` what-ifs, run after the analysis ``auto`` reads."""
    report = base_report(step)
    changed = step.meta.get("changed_in_step")
    if changed:
        report["problems"].append(written_notes.elsewhere_note(step.meta) if _elsewhere(step)
                                  else written_notes.changed_note(changed))
    if step.meta.get("scaler_not_given"):  # (a GradScaler's skipped step may be no bug)
        report["problems"].append((said := scaler_not_given(step.meta))[0].lower() + said[1:-1])
    if (late := sorted(_late(step))) and not step.event.get("before_update"):
        report["problems"].append(written_notes.late_note(late, step))
    known = Known()  # (the plain re-run: what a report keeps when a later stage fails)
    report = report_update_linalg(report, step) or state_report(report, step) or _from_bundle(
        report, step) or kept_going(report, step, known, lambda: _from_rerun(report, step, known))
    report["problems"] += module_hooks.notes(step, report)  # (the script's forward hooks)
    tied_names.annotate(step, report)  # (a tied parameter's other names)
    if note := statistics_note(step, report) or written_statistic_note(step, report):
        report["problems"].append(note)  # (a BatchNorm statistic an outlier overflowed)
    if note := number_note(step, report):  # (a NaN number the forward took: no input)
        report["problems"].append(note)
    if note := flushed_note(step, report):  # (torch.set_flush_denormal(True), the run's)
        report["problems"].append(note)
    if note := eval_with_grad(step.meta, report["origin"].get("micro_batch")):
        report["problems"].append(note)  # (a validation batch run without no_grad)
    if not survived(report, add_window, step, report) and below_zero(step) is None:
        diverging_hint(report, step)  # (else the precursors; a rate below 0 climbed: no fix)
    update_rule_hints(step, report)  # (maximize=True, lr < 0, a decay that grows the weights)
    survived(report, checked_eps, step, report)  # (an eps the hint proposes, re-run first)
    o = report["origin"]
    # whether the samples are the whole batch: "all 64 rows" says more than 64 numbers
    o["batch_size"] = batch_size(step, o.get("micro_batch") or 0) or None
    o["all_samples"] = bool(o["batch_size"]) and o["samples"] == list(range(o["batch_size"]))
    # (a micro-batch the loss opened by calling the model: the report says which call it is)
    o["forward_in_loss"] = ran_in_loss(step.micro_batches, step.meta.get("loss"),
                                       o.get("micro_batch"))
    survived(report, data_hints, report, step)  # (a chunk's rows, an outlier, a mask's 0)
    relu_recurrence_hint(report, step)  # (an IRNN's weight_hh of radius 1.5, a long sequence)
    if tries:
        report["what_if"] = survived(report, run_tries, step, report, list(tries))
    return report


def analyze_bundle(path, factory: str | None = None, device: str | None = None,
                   factory_kwargs: dict | None = None, tries: Sequence[str] = ()
                   ) -> dict[str, Any]:
    """The report for the bundle at ``path`` (read, built, analysed, then the ``tries``).
    Under DDP a NaN that one rank's backward made inside the model reaches every rank's
    gradients through the all-reduce, so every rank saw a backward event at once and all are
    first (``recorder.ranks``): the first one's step, finite alone, is not the event; each
    other first rank's step is replayed until one reproduces it."""
    with contextlib.ExitStack() as switches:
        switches.callback(put_back_classes)  # (the user's classes as found: replay.class_kept)
        step = _built(path, None, factory, device, factory_kwargs, switches)
        return _analyzed(step, path, factory, device, factory_kwargs, tries)


def _analyzed(step: Step, path, factory, device, factory_kwargs, tries) -> dict[str, Any]:
    report = analyze(step)
    ranks = step.event.get("ranks") or {}
    for rank in _other_firsts(step.path, step.meta):
        if report["reproduced"] or step.event.get("phase") != "backward":
            break
        other = _built(path, rank, factory, device, factory_kwargs)
        again = analyze(other) if other.path != step.path else {"reproduced": False}
        if again["reproduced"] or (cast_overflowed(again) and not cast_overflowed(report)):
            how = ("each rank checked the step alone (an exception cut it short)"
                   if ranks.get("alone") else f"rank(s) {ranks['first']} saw the event at once")
            again["problems"].append(f"{how}; {made_on_rank(again, report['bundle']['rank'], rank)}")
            step, report = other, again
    if tries:
        report["what_if"] = survived(report, run_tries, step, report, list(tries))
    return report


def _other_firsts(path, meta: dict[str, Any]) -> list[int]:
    """The ranks, after the one replayed, that may have made the event: the other first
    ranks; every other rank with a bundle beside it when the step was checked on each rank
    alone (cut short by an exception: the ranks did not agree who saw it first)."""
    ranks = meta["event"].get("ranks") or {}
    if ranks.get("alone"):
        return [r for r in sorted(shard_set(Path(path), meta)) if r != ranks.get("rank")]
    return sorted(ranks.get("first") or [])[1:]


def _built(path, rank: int | None, factory, device, factory_kwargs,
           switches: contextlib.ExitStack | None = None) -> Step:
    step = read_step(path, rank)
    if switches is not None:  # (before the factory: its modules may build distributions)
        switches.enter_context(run_switches(step))
    try:
        build(step, factory, device, factory_kwargs)
    except FactoryRefused as e:
        step.problems.append(str(e))
    settle_loss_started(step)  # (the loss's own state as the step began; see replay.loss_own)
    return step


def _elsewhere(step: Step) -> bool:
    """The recorder's optimizer never stepped; another one updated every weight mid-step."""
    return bool(step.meta.get("stepped_elsewhere"))


def _strict(step: Step) -> bool:
    """The +-Inf policy: by default (False) a batch's or buffer's +-Inf is bad only if NaN."""
    return bool(step.meta.get("strict_inf", True))


def _after_update(step: Step) -> bool:
    """The bundle holds the weights after the optimizer update that made the event."""
    return step.event.get("phase") == "optimizer" and step.meta.get("state") == "after_update"


def _from_bundle(report, step: Step) -> dict[str, Any] | None:
    """The report when the bundle alone decides (bad input or weights, an update not re-run)."""
    after_update = _after_update(step)
    # buffers the forward itself wrote non-finite (in an earlier step) are re-run, not blamed
    written = {} if after_update else forward_written(step)
    report["problems"].extend(state_notes(step, written))
    bad_weights = [n for n in non_finite_weights(step) if n not in written]
    if after_update and (bad_weights or "weights" in step.stripped):
        # the update's own evidence first: a batch that is non-finite too came after it (a
        # GAN's fakes from a generator the same kind of update broke), not before
        params, others = update_params(step, bad_weights)
        if (unseen := report_unrecorded(report, step, params)) is not None:  # (no step)
            return unseen
        report["problems"].extend(filter(None, [others_note(step, others)]))
        hint = params and after_update_hint(step, params)
        if not hint and (before := nan_before_update(report, step, params)) is not None:
            return before  # (NaN the loop wrote after the update before: a renorm's 0/0)
        mark_update_not_rerun(report, step)
        o = origin_fields(phase="optimizer", params=params, param=(params or [None])[0])
        return finish(report, o, "optimizer", reproduced=False, hint=hint)
    inputs, targets = ([i for i, mb in enumerate(step.micro_batches) if mb.get(k)]
                       for k in ("inputs_changed", "targets_changed"))
    if targets and (not inputs or step.event.get("phase") == "loss"):  # (what the loss took)
        return _targets_changed(report, step, targets[0])
    if inputs:  # (an input the loop trains: its update wrote it, DeepDream's Adam's)
        return _input_changed(report, step, inputs[0], trained_input_hint(step))
    if step.event.get("phase") == "input":
        return _input_event(report, step)
    if (written := _written_inputs(report, step)) is not None:
        return written
    if batch_non_finite(step, ("batch/",), nan_only=not _strict(step)):
        o = input_origin(step)
        return finish(report, o, "input", reproduced=True, hint=data_hint(o, step))
    changed = set(step.meta.get("changed_in_step") or ()) | _late(step)
    if bad_weights and not after_update and set(bad_weights) <= changed:
        return _weights_written_late(report, step)
    written = set(step.meta.get("written_in_step") or ())
    if not after_update and (loop := report_loop_written(report, step, bad_weights, written)):
        return loop  # (written between micro-batches by the loop, not by a forward)
    if bad_weights and not after_update and set(bad_weights) <= written:
        # written by the step's own code before any update (a data-dependent init in the
        # forward): the re-run runs that code again from the step's pre-step buffers
        report["problems"].append(written_notes.written_note(sorted(written)))
    elif bad_weights and not after_update:
        return report_weights(report, step, bad_weights)
    if after_update:
        report["problems"].append(
            "the recorded update left non-finite weights, yet every weight in the bundle is "
            "finite: the event does not come back from the bundle; re-running the step instead")
    if step.model is None:
        # Nothing can be re-run (weights stripped, factory refused): say what the recorder saw
        # and leave the cause open rather than guess.
        report = recorded_origin(report, step, (
            "nothing was re-run, so the op and the cause are unknown: the origin above is what "
            "the recorder saw; replay the full bundle where its factory can be imported to name "
            "the op"))
        parts = sorted(set(step.stripped))
        report["not_rerun"] = f"{' and '.join(parts)} stripped" if parts else "factory not imported"
        return report
    return statistic_came_in(report, step)  # (a BatchNorm statistic bad as the step began)


def _input_event(report, step: Step) -> dict[str, Any] | None:
    """The report of an input event from the bundle (None: the re-run runs the step)."""
    o = input_origin(step)
    made = made_from_imputed(report, step, o)  # (RERUN, an empty dict: re-run the step)
    if made is None:
        made = made_by_input_gradient(report, step, o)
    if made is not None:
        return None if made is RERUN else made
    return finish(report, o, "input", reproduced=True, hint=infinity_the_loss_took(
        step, o) or masked_loss_hint(step, o) or derived_input_hint(step, o)
        or trained_input_hint(step, o) or target_input_hint(step, o) or data_hint(o, step))


def _late(step: Step) -> set[str]:
    """Weights a loop without an optimizer made non-finite after the step's forward read
    them finite (its own update, from this step's gradients; the recorder's
    ``written_after_forward``)."""
    return set(step.event.get("written_after_forward") or ())


def _weights_written_late(report, step: Step) -> dict[str, Any]:
    """Weights non-finite only after the step's forward ran (another optimizer's step(), or
    the loop's own update, wrote them from this step's gradients): not what the step ran with,
    so nothing to re-run."""
    if step.event.get("before_update"):  # (between backward and step(): RigL's regrowth)
        return written_before_update(report, step)
    hand = _late(step) and not step.meta.get("optimizer")
    fix = (written_notes.own_update_fix(step) if hand else
           "it is in the step's first forward, which ran on the weights before the write"
           if _late(step) else
           "give FlightRecorder the optimizer the loop steps" if _elsewhere(step) else
           "call the recorded optimizer's step() before the other one's (see the note)")
    report = recorded_origin(report, step, (
        "the step cannot be re-run as it ran, since the bundle holds weights written after "
        f"its forward: the origin above is what the recorder saw; {fix}"
        + ("" if _late(step) and not hand else " and record again")))
    report["not_rerun"] = "weights written after its forward"
    return report


def _input_written(report, step: Step) -> dict[str, Any]:
    """The forward wrote into its input in place the first time the recorder saw it do so:
    the bundle holds that input as the forward left it (the recorder copies the inputs from
    the next micro-batch on), so the step cannot be re-run."""
    written = [i for i, mb in enumerate(step.micro_batches) if mb.get("inputs_written")]
    report["problems"].append(
        f"the model's forward wrote into its input in place (micro-batch {written[0]}) the "
        "first time the recorder saw it do so: the bundle holds that input as the forward "
        "left it, not as it came in, and the step cannot be re-run from it")
    report["not_rerun"] = "input written by the forward"
    return recorded_origin(report, step, (
        "the origin above is what the recorder saw; write into a copy of the input "
        "(x = x / peak, not x.div_(peak)), or record from before this step: from the next "
        "micro-batch on the recorder keeps the inputs as they come in"))


def _written_inputs(report, step: Step) -> dict[str, Any] | None:
    """The report of a step whose forward wrote into its inputs, or whose loop stepped a
    forward's input in place after it (a sampler's .data writes), else None."""
    if any(mb.get("inputs_written") for mb in step.micro_batches):
        return _input_written(report, step)
    if (stepped := stepped_after_forward(step)) is not None:
        return _input_changed(report, step, stepped, STEPPED_IN_PLACE)
    return None


def _input_changed(report, step: Step, mb: int, hint: str | None = None) -> dict[str, Any]:
    """The loop wrote into the batch after the forward, before the step closed (a batch whose
    tensors view the dataset's, which the loop cleaned in place): the bundle holds what the
    loop left, not what the step ran on, so neither it nor a re-run says what the step saw."""
    report["problems"].append(
        f"the loop wrote into the model's input in place after the forward (micro-batch {mb}), "
        "before the step closed: the bundle holds that input as the loop left it, not as the "
        "step ran on it, and the step cannot be re-run from it")
    report["not_rerun"] = "input written after the forward"
    return recorded_origin(report, step, hint or (
        "the origin above is what the recorder saw; a batch whose tensors view the dataset's "
        "storage (slices of one tensor, batch_size=None), or a buffer the loop reuses for "
        "every micro-batch (static_x.copy_(x)), shares every in-place write to it: write into "
        "a copy (x = x.clone()) or change the data only after optimizer.step(); a reused "
        "buffer is copied by the recorder from the micro-batch after the first write on"))


STEPPED_IN_PLACE = (
    "the origin above is what the recorder saw; the next forward took this forward's input "
    "tensor itself, which the loop stepped in place through .data (a Langevin sampler's "
    "x.data.add_(-step * x.grad)), carrying this forward's NaN into it: step out of place "
    "(x = x - step * g) or pass a copy (model(x.clone())); the recorder copies such inputs "
    "from the next forward on, so an event of a later step is re-run")


def _targets_changed(report, step: Step, mb: int) -> dict[str, Any]:
    """The loop wrote into the loss's targets after the loss took them, the first time the
    recorder saw it do so (one label buffer reused for every micro-batch): the bundle holds
    them as the loop left them, so a re-run would compute another loss."""
    report["problems"].append(
        f"the loop wrote into the loss's targets in place after the loss took them (micro-batch "
        f"{mb}), before the step closed: the bundle holds them as the loop left them, not as "
        "the loss took them, and the step cannot be re-run from them")
    report["not_rerun"] = "loss targets written after the loss"
    return recorded_origin(report, step, (
        "the origin above is what the recorder saw; a buffer the loop reuses for the targets "
        "of every micro-batch (sy.copy_(y)) is copied by the recorder from the micro-batch "
        "after the first write on, so a later event replays; or pass a fresh tensor (y, or "
        "y.clone()) to the loss"))


def _from_rerun(report, step: Step, known: Known) -> dict[str, Any]:
    """The report from two re-runs of the step: which phase made the first non-finite value."""
    phase = step.event.get("phase")
    runner = Runner(step)
    if step.event.get("kind") == "scale":  # a GradScaler event: re-run the scaled backward
        runner.loss_scale = scale_of_the_step(step)
    run1, run2 = runner.run_twice(report)  # (from the same weights: refit_in_forward)
    known.run = run1
    if run1.signature() != run2.signature() and not rounding_only(report, run1, run2, runner):
        return disagreeing(report, step, runner)  # (a torch.empty's garbage: unwritten_rerun)
    report["fidelity"] = fid = fidelity.compare(step, run1, runner.frozen_written())
    report["problems"] += fidelity.notes(fid, step) + handled_notes(run1)  # (what each says)
    if fid is not None and not fid["matches"]:
        if (second := report_second_order(report, step, runner, fid)) is not None:
            return second  # (a MAML outer backward through an earlier micro-batch's gradient)
        # what the re-run shows is of another model: nothing it finds is evidence
        return recorded_origin(report, step, (
            f"{fidelity.mismatch(fid)}, so the re-run says nothing about training: the origin above is what the "
            "recorder saw; see the fidelity line"))
    origin = run1.forward_origin()
    if not _strict(step) and run1.chain()[2] and not run1.loss_first(origin):  # (came in)
        o = input_origin(step)
        return finish(report, o, "input", reproduced=True, hint=data_hint(o, step))
    if run1.error is not None:
        if origin is None and all(run1.loss_finite) and not run1.bad_grads:
            return _failed(report, step, run1, runner)  # before anything went non-finite
        report["problems"].append(raised_note(run1))
    if origin is not None and not run1.loss_first(origin):
        return add_iterates_note(report_forward(report, step, runner, run1, origin), run1)
    if run1.loss_finite and not all(run1.loss_finite):
        return report_loss(report, step, runner, run1)
    # the recording's forward and loss were finite (a backward event; a loss event of a loss
    # the replay cannot re-run), the re-run's too: did the values enter from outside?
    outside_loss = phase == "backward" or (phase == "loss" and step.loss_fn is None)
    if phase == "backward" and step.loss_fn is not None and not run1.bad_grads and \
            (own := report_loss_backward(report, step, runner)) is not None:
        return own  # (only when the loss_fn re-ran: a loss node made the entering gradient)
    if outside_loss and not run1.bad_grads and (entered := report_fed_back(  # (a rollout's)
            report, step, runner, run1) or report_entering(report, step, runner)) is not None:
        return unrebuilt_loss(entered, step)  # (a loss it could not re-run)
    if phase == "loss" and (given := report_given_loss(report, step, runner, run1)) is not None:
        return given  # (a term the loop added to loss_fn's loss, given to record_loss)
    if phase == "loss" and step.loss_fn is None:  # (or a term the forward kept aside made it)
        return report_hidden_forward(report, step, runner) or report_loss_not_in_bundle(
            report, step)
    if run1.bad_grads:  # (an inner loop's gradient, which a later forward's weights came from)
        return add_iterates_note(adapted_from_gradient(report_backward(report, runner), step), run1)
    if step.event.get("reason") == "anomaly":
        return report_dropped_nan(report, runner)
    if phase == "optimizer" and not _after_update(step) and step.optimizer is not None:
        return report_optimizer(report, step, runner)
    if (made := report_made_weights(report, step, run1)) is not None:
        return made  # (a MAML query forward on weights its inner update made non-finite)
    if (wrote := report_written_forward(report, step, runner, run1)) is not None:
        return wrote  # (NaN the forward wrote into the weights: TransE's in-place renorm)
    if (term := loop_differentiation(step)) is not None:  # before the branch below: that
        return not_rerun_term(report, step, term)  # term may be all the backward went through
    if phase == "backward" and _no_backward_reached_the_output(step):  # (losses kept aside)
        return report_kept_aside(report, step, runner) or _gradients_from_the_loop(report, step)
    return _not_reproduced(report, step, runner, phase)


def _not_reproduced(report, step: Step, runner: Runner, phase: str) -> dict[str, Any]:
    """Nothing re-run made the event: a forward value no module output carried (an aux loss
    the loop added), or else what the bundle does not hold."""
    if phase in ("backward", "loss") and (hidden := report_hidden_forward(
            report, step, runner)) is not None:
        return hidden
    if step.code_edits:  # (the user's edit since the run, not what the bundle lacks)
        return edited_not_reproduced(report, step)
    if phase == "backward" and ((kept := report_kept_aside(report, step, runner)) is not None
                                or (kept := report_graph_args(report, step)) is not None):
        return kept
    if phase == "backward" and _finite_gradients_reached_the_output(step):
        return _gradients_from_the_loop(report, step, reached=True, runner=runner)
    if (moved := report_moved_weights(report, step, runner)) is not None:
        return moved
    report["problems"].append(f"the recorded {phase} event did not come back in the re-run")
    report = finish(report, origin_fields(), "not_reproduced", reproduced=False)
    # the two re-runs agree with each other: no reason to suspect the hardware
    report["hint"] = (
        "the two re-runs agree with each other but not with the recording, which they otherwise "
        "match: what decided the event is not in the bundle (state outside the model such as a "
        "counter, a global or a random generator of your own; data-dependent code outside the "
        "recorded model) or it was transient; re-run training from the step before with the "
        "same data to tell which")
    note_outside_state(report, step, runner)  # (a cache the run filled; a loss's own EMA)
    # (what the bundle can name: a setting made after build, hooks the script registered)
    report["hint"] = (fidelity.rebuilt_otherwise(step) or unsharded_hint(step.meta)
                      or report["hint"])
    return note_unwritten(report, step, runner)  # (garbage a torch.empty held, NaN in the run)


def _failed(report, step: Step, run, runner: Runner) -> dict[str, Any]:
    """The re-run raised before anything went non-finite: a failed decomposition (see
    replay.linalg), else the replay failed, unless the step's code called torch.distributed:
    the one-process replay has no process group, so the report is what the recorder saw."""
    if (failed := report_raised(report, step, runner, run)) is not None:
        return failed  # a decomposition or a distribution refusing a value (replay.refused)
    called = distributed_call(run.error)
    if called is None:  # (state the loop set outside forward, else the replay failed)
        return recorded_origin(report, step, unset_state_or_raise(run.error, runner.model))
    where, fn = called
    world = (step.meta.get("env") or {}).get("world_size")
    return recorded_origin(report, step, (
        f"the step's code calls {fn}{f' at {where}' if where else ''}, which needs the process "
        f"group of the run's {world or 'several'} ranks; the replay runs one process without "
        "it, so the step was not re-run and the origin above is what the recorder saw: to "
        "replay it, skip that call when torch.distributed.is_initialized() is False (the "
        "re-run then computes with this rank's values alone)"))
