"""The origin of the other events: weights non-finite before the step, a non-finite loss (re-run
with the op finder), a loss the bundle cannot re-run, a gradient entering the model from
outside; the backward's is :mod:`replay.backward_report`'s, the optimizer's update
:mod:`replay.optimizer_origin`'s.
"""

from __future__ import annotations

from typing import Any

from recorder.capture import tensor_leaves
from recorder.finite import finite, kind_of

from . import below_one, output_places, outside
from .backward_report import backward_fields as _backward_fields
from .backward_report import node_hints, report_backward
from .cached_grads import cached_hint, gradient_cached
from .cause import classify
from .cause_text import inf_arith
from .copied_rows import recause
from .coupled import coupled_rows
from .cumsum_diff import cumsum_diff_hint
from .cumsum_divisor import cumsum_divisor_hint
from .derived_args import derived_arg_report
from .dropped_grads import finite_params_note
from .empty_mask import loss_reproduced
from .exp_overflow import exp_overflow_hint
from .findings import finish, origin_fields
from .forward import with_param_advice
from .forward_grad import with_node
from .held_divisor import held_divisor_hint, loss_buffers
from .hits import hit_sources
from .iteration import loss_line_run
from .load import Step, autocast_as_recorded
from .logged_output import logged_output_cause
from .looked_up import looked_up_hint
from .loop_term import loop_differentiated, loop_term_report, spread_by_term
from .loss_arg_name import with_param_name
from .loss_args import loss_args, loss_samples
from .loss_factor import infinite_factor_hint
from .loss_grad import node_in_loss, probed_report
from .loss_infinities import LossCall, infinity_advice, others_text
from .loss_maker import loss_op_finder
from .loss_node import loss_node
from .loss_swapped import not_called_note
from .losses import held_state_cause, non_finite_loss_state
from .masked_targets import watched_loss_rerun
from .nan_factor import nan_factor_text
from .negative_output import negative_output_hint
from .nonpositive_output import nonpositive_output_text
from .object_outputs import came_inside_objects, report_forward_behind_objects
from .padded_rows import unpadded_rows
from .param_writes import (
    built_non_finite_hint,
    by_update,
    forward_made,
    forward_made_hint,
    loop_written_hint,
    own_update_hint,
)
from .piecewise_linear import zero_divisor_hint
from .product_underflow import loss_lineage_hint
from .rerun import Runner
from .run_result import Run
from .self_pairs import self_pair_hint
from .swapped_in import passed_in_note, swapped_in_hint
from .term_args import report_term_arg
from .weight_readers import bad_row_fields, first_reader, rows_text
from .written_forward import report_forward_wrote


def report_weights(report, step: Step, bad: list[str]) -> dict[str, Any]:
    """Weights non-finite when the step began. The recorder's evidence from right after the
    last update (``last_update_step``) says the update left them finite: written since, outside
    ``optimizer.step()``."""
    ev = step.event
    late = set(ev.get("written_after_forward") or ())  # (not bad as the step began)
    bad = [n for n in bad if n not in late] or bad
    if (wrote := report_forward_wrote(report, step, bad)) is not None:
        return wrote  # (trained ones an earlier forward wrote: TransE-PyTorch's renorm)
    if (made := forward_made(step, bad)) is not None:  # (frozen ones the forward wrote)
        numbers = list(made["numbers"])
        o = origin_fields(phase="input" if numbers else "weights", params=made["params"],
                          param=made["params"][0], tensor=(numbers or [None])[0],
                          op=made["op"], source=made["source"], made=made["kind"])
        return finish(report, o, "input" if numbers else "weights", reproduced=True,
                      hint=forward_made_hint(step, made))
    seen, last = ev.get("first_seen_step"), ev.get("last_update_step")
    buffer = bad[0] in set(step.meta.get("buffers") or ())  # (a BatchNorm's running_var)
    rows = bad_row_fields(step, bad[0])
    report = finish(report, origin_fields(phase="weights", params=bad, param=bad[0],
                                          tensor="buffer" if buffer else None,
                                          first_seen_step=seen, last_update_step=last,
                                          # (not weights written after the forward read them)
                                          **({} if late else first_reader(step)), **rows),
                    "weights", reproduced=True,
                    hint=built_non_finite_hint(step, bad) or swapped_in_hint(step, bad)
                    or loop_written_hint(step, bad)
                    or (None if step.meta.get("optimizer") else own_update_hint(step)))
    report["cause"] = "optimizer" if by_update(step, report["hint"]) else report["cause"]
    if (where := rows_text(bad[0], rows)) is not None and report.get("hint"):
        report["hint"] = f"{report['hint']}; {where}"
    if (passed := passed_in_note(step, bad)) is not None:
        report["problems"].append(passed)
    elif last is not None:
        report["problems"].append(
            f"{bad[0]} was first seen non-finite at step {seen}; the last update (step {last}) "
            "left it finite, so it was written outside optimizer.step() since: an in-place "
            "edit, a checkpoint or state_dict load, another process, a hardware fault")
    return report


def _made_of(runner: Runner, finder, cause, hit) -> str | None:
    """The loss origin's hint, with what its op was part of: a log-sum-exp by hand or a count
    (``replay.lineage``), an exp's overflow inside a softmax by hand (an InfoNCE's
    ``exp(sim / tau)``, ``replay.exp_overflow``)."""
    hint = loss_lineage_hint(finder.lineage, cause, hit)
    hint = cumsum_diff_hint(runner, hint, cause.name, hit)  # (a summed-area table's box sum)
    # (a running mean's cumsum(x) / cumsum(mask), a Cox loss's risk-set sum, still 0)
    hint = cumsum_divisor_hint(runner, hint, cause.name, hit, loss=True)
    return exp_overflow_hint(runner, hint, cause.name, hit)


def report_loss(report, step: Step, runner: Runner, run: Run) -> dict[str, Any]:
    mb = run.loss_micro_batches[run.loss_finite.index(False)]
    if (found := node_in_loss(step, runner, mb)) is not None:  # the model's backward, there
        b, probed = found
        if probed:
            return probed_report(report, step, _backward_fields(b), b)
        cause = classify(runner, "backward", node=b.node, saved=b.saved, at_pole=b.saved_zero,
                         underflowed=b.positive_input, dtype=b.dtype, edge=b.edge_input)
        cause = recause(cause, b.node, b.copied, dict(runner.model.named_parameters()))
        cause = below_one.recause(cause, b.node, b.complement, b.saved_zero)
        cause.hint = node_hints(b, cause)
        return finish(report, {**_backward_fields(b), "phase": "loss"}, cause.name,
                      reproduced=step.event.get("phase") == "loss", hint=cause.hint)
    # (a graph kept for the loss's autograd.grad; the samples where the forward moved them)
    run, moved = output_places.loss_run(runner, run, mb)
    finder = loss_op_finder(runner)  # (the loss's parameters: <loss>.NAME; its buffers)
    args, kwargs = loss_args(step, run, mb, finder, moved)
    with autocast_as_recorded(step.micro_batches[mb], step.device, loss=True), finder:
        loss = step.loss_fn(*args, **kwargs)
    made = next((kind_of(t) for t in tensor_leaves(loss) if not finite(t)), None)
    del loss
    # no op made it of finite inputs: the loss folded in an infinity the output may hold (a -inf
    # mask, allow_inf), or took a buffer it holds non-finite (EWC's Fisher, Deep SVDD's NaN c)
    held = non_finite_loss_state(step.loss_fn)
    hit = finder.blamed(made) or (  # (first_met: a held inf met the data: w * q, before sum)
        (finder.first_held or finder.first_met) if held else None) or finder.first_reduced
    if hit is None and (term := report_term_arg(report, step, mb, runner)) is not None:
        return term  # (a penalty the loop made of the weights, given to the loss: passed on)
    if hit is finder.first_nan and hit and not finder.first and not finder.intentional:
        # made of infinities the model output holds, which allow_inf let it hold (a mask)
        hit.from_mask = not all(finite(t) for t in tensor_leaves((args, kwargs)))
    origin = origin_fields(
        phase="loss", module="<loss>", micro_batch=mb, op=hit.op if hit else None,
        **hit_sources(hit), chain=finder.chain(made),
        samples=loss_samples(step, run, mb) or unpadded_rows(hit, args, kwargs)
        or (hit.rows if hit else None) or [],
        made=hit.made if hit else made, line_run=loss_line_run(step, mb, hit, args, kwargs),
        # (its line's run, a loop over scales; the dtype of a half output the loss took as is)
        **({"dtype": str(hit.evidence.dtype).removeprefix("torch.")}
           if hit and hit.evidence else {}))
    if coupled := coupled_rows(step, run, mb, origin["samples"]):
        origin["coupled"] = coupled  # (a DPO pair: what --try drop must drop together)
    held = held if hit is not None else None
    if came_inside_objects(hit, args, kwargs, held) and (
            fwd := report_forward_behind_objects(report, step, runner, mb, hit)) is not None:
        return fwd
    cause = held_state_cause(classify(runner, "loss", hit=hit, micro_batch=mb), hit, held, step)
    if hit is not None and hit.from_mask:  # (or the loop's log of an output: q.log())
        cause = logged_output_cause(cause, step, mb, run.outputs[mb], hit.op)
    hint = _made_of(runner, finder, cause, hit)  # (a log-sum-exp or a softmax by hand)
    hint = negative_output_hint(runner, mb, hit, cause.name, hint)  # (below 0; a slot left 0)
    bufs = loss_buffers(step.loss_fn)  # (<loss>.p_model; <loss>.counts a 0 of the ids picked)
    hint = held_divisor_hint(hint, cause.name, finder, hit, bufs) or hint
    hint = (cause.name == "invalid" and looked_up_hint(hint, bufs, finder, hit)) or hint
    hint = self_pair_hint(zero_divisor_hint(runner, mb, hit, cause.name, hint), cause.name, hit)
    return finish(report, origin, cause.name, reproduced=loss_reproduced(step),
                  hint=with_node(origin, with_param_advice(hint, cause.name, hit, step),
                                 cause.name, loss_node(step, runner, run, mb, moved, hit, made)))


def infinity_the_loss_took(step: Step, origin: dict[str, Any]) -> str | None:
    """The hint for an input event whose tensor is a loss argument holding +-inf and no NaN
    (a log-probability target of exactly 0 under ``KLDivLoss(log_target=True)``): the loss
    re-run under the op finder names the op that made NaN of it. None when the event is
    another one or nothing can be re-run. Only such an event pays for the re-run."""
    tensor, made = origin.get("tensor") or "", origin.get("made")
    if not tensor.startswith("loss_") or made not in ("+inf", "-inf") \
            or step.model is None or step.loss_fn is None:
        return None
    call = LossCall()
    finder = watched_loss_rerun(step, origin.get("micro_batch") or 0, accept=call)
    hit = finder and finder.first_nan
    if hit is None:
        return None
    what = inf_arith(hit.op, "NaN from infinities")
    at = f" ({hit.source})" if hit.source else ""
    # (the op may take another argument's infinity than the one the recorder named first)
    others = others_text(call, tensor, step.loss_fn)
    of = "of infinities" if others else "of it"
    return (f"{with_param_name(tensor, step.loss_fn)} holds {made} and no NaN{others}, and "
            f"the loss made NaN {of}: {hit.op}{at} computed {what}. "
            + infinity_advice(made, step.loss_fn))


def report_loss_not_in_bundle(report, step: Step) -> dict[str, Any]:
    """A loss event with no loss to call: one computed inline and given to ``record_loss``
    (the Lightning callback's ``training_step`` loss), or a recorded loss that cannot be
    rebuilt (its note says why). The model's outputs re-ran finite, which is as far as the
    bundle goes."""
    ev = step.event
    report = finish(report, origin_fields(phase="loss", module="<loss>",
                                          micro_batch=ev.get("micro_batch"), made=ev.get("kind")),
                    None, reproduced=False)
    # the model re-ran, its loss could not: "NOT reproduced" would read as nondeterminism
    report["not_rerun"] = outside.NOT_REBUILT
    if (step.meta.get("loss") or {}).get("kind") == "recorded":
        report["problems"].append(
            "the loss was given to record_loss (computed outside the recorded model), so the "
            "bundle holds its value but nothing to re-run it with; the model's outputs re-ran "
            "finite")
    report["hint"] = ("the loss computation made the value from finite model outputs: check "
                      "its inputs (every target ignored gives a 0/0 mean; log of a zero "
                      "probability) and the terms it adds (a penalty on the weights: EWC's "
                      "Fisher or SI's importance, 0/0 for a weight the task never used). "
                      + _sentence(outside.replayable_loss_hint(step)))
    return report


def _unmatched_grads_note(step: Step, reproduced: bool) -> str | None:
    """Why the model's backward of the recorded output gradient is not the recording's: no
    gradients held to compare with, or other non-finite parameters than the recorded."""
    if not outside.grads_held(step):
        return ("the bundle holds no gradients (the step closed after the loop cleared them, "
                "as a GradScaler's skipped update and the next zero_grad() do), so the "
                "gradients the recorded output gradient gives were not compared")
    if not reproduced and outside.loop_differentiated_forward(step) is None:
        return ("feeding the recorded output gradient through the model's backward did not "
                "give the recorded non-finite parameter gradients back")
    return None


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def report_entering(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The model re-ran finite and as recorded, its backward from the re-run loss (if any) too:
    a non-finite gradient recorded at the model's output came from a loss the replay cannot
    re-run (see replay.outside)."""
    found = outside.entering_origin(step, runner)
    if found is None:
        grads = outside.recorded_output_grads(step)
        if not outside.non_finite_entries(grads):
            return None
        # the model's backward makes non-finite values of its own as well: find them with
        # the entering gradient's non-finite entries set to 0
        runner.out_grads = outside.zeroed(grads)
        try:
            report = report_backward(report, runner)
        finally:
            runner.out_grads = None
        report["problems"].append(
            "the gradient entering the model's output was non-finite too (the loss made it); "
            "the backward origin above was found with those entries set to 0")
        if outside.loss_fn_not_called(step):
            report["problems"].append(_not_called(step))
        return report
    fields, reproduced = found
    if (derived := derived_arg_report(report, step)) is not None:  # (flip-test averaging)
        return derived
    report = finish(report, origin_fields(**fields), None, reproduced=reproduced)
    info = step.meta.get("loss") or {}
    if info.get("kind") == "recorded":
        report["problems"].append(
            "the loss given to record_loss was computed outside the recorded model, so the "
            "bundle holds its value but nothing to re-run it with")
    elif outside.loss_fn_not_called(step):
        # not re-run at all: saying it "re-ran finite" would clear a loss that may hold the bug
        report["problems"].append(_not_called(step))
    elif step.loss_fn is not None:
        report["problems"].append(outside.rerun_finite_note(step))
    if (unmatched := _unmatched_grads_note(step, reproduced)) is not None:
        report["problems"].append(unmatched)
    elif (spread := outside.spread_after_backward(step, fields["params"])) is not None:
        mb = fields.get("micro_batch")  # (a derivative term's backward reaches them itself)
        report["problems"].append(spread_by_term(mb) if loop_differentiated(step, mb)
                                  else spread)
    elif not fields["params"]:
        report["problems"].append(finite_params_note(step, fields.get("micro_batch"), "the loss"))
    elif (zeroed := outside.scrubbed_note(step, fields["params"])) is not None:
        report["problems"].append(zeroed)  # (ADA's nan_to_num of every gradient)
    if scaled := infinite_factor_hint(step, fields.get("micro_batch")):  # (a loss scale of inf)
        report["cause"], report["hint"] = "overflow", scaled
        return report
    report["hint"] = (outside.replayable_loss_hint(step)
                      + nan_factor_text(step, fields.get("micro_batch"))
                      + nonpositive_output_text(runner, fields.get("micro_batch"), fields["samples"]))
    if loop_term_report(report, step, runner, fields.get("micro_batch"),
                        fields.get("samples")):
        return report
    if gradient_cached(step):  # (GradCache's re-run chunks, given the cached gradient)
        report["hint"] = cached_hint(step, fields.get("micro_batch"), report["hint"])
    return report


def _not_called(step: Step) -> str:
    return not_called_note(step)
