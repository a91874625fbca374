"""The origin of a backward event: the node :mod:`replay.backward` found, its fields and cause
(worded by what it saved), the forward op that made a value it saved and carried on without a
non-finite output, a NaN anomaly mode stopped at that the re-run drops, and a loss node's own
backward into the model's output."""

from __future__ import annotations

import linecache
import re
from typing import Any

from recorder.finite import label

from . import below_one, summed_grads, through_time
from .anomaly_stop import UNSEEN_HINT, anomaly_note
from .backward import find_backward_origin
from .cause import classify
from .cause_text import DO
from .copied_rows import recause
from .dropped_grads import finite_params_note
from .exp_factor import exp_factor_hint
from .exp_forms import exp_form_hint
from .exp_overflow import exp_overflow_hint
from .findings import finish, origin_fields
from .forward import find_op_in_call
from .fractional_power import fractional_power_hint
from .grad_hooks import hook_fields, hook_hint
from .held_divisor import held_divisor_hint, loss_buffers
from .huge_upstream import upstream_cause
from .input_text import ALLOWED_NAN_SAVED
from .load import Step
from .looked_up_divisor import looked_up_divisor_hint
from .loss_maker import made_in_loss
from .masked_pole import with_masked_pole
from .other_makers import add_others
from .other_rows import note_grad_rows
from .pole_hints import pole_hint
from .power_grad import steep_power_cause
from .raw_pole import raw_pole_hint
from .recorded import allowed_nan_held, input_origin, samples
from .rerun import Runner
from .saved_input import saved_input
from .self_pairs import self_pair_hint
from .twice_differentiated import twice_hint
from .zero_start_distance import zero_start_hint


def _saved_value_maker(runner: Runner, mb: int, node: str | None, saved: str,
                       in_loss: bool = False):
    """(op, cause, whether its divisor is a buffer held at 0: :mod:`replay.held_divisor`) of
    the forward op that made the first non-finite value of micro-batch
    ``mb`` from finite inputs (a log of 0 whose -inf a tanh then saturated; a rotary cache's
    NaN that CPU attention dropped from its output), which backward ``node`` saved as
    ``saved``: that op, not the node, is where the value started. None when no op made one
    (or only a literal fill, a mask), a NaN when an infinity was saved, or when it is the
    node's own op (exp's overflow, 1/0 in a masked branch), which the node's cause describes."""
    finder = find_op_in_call(runner, "", 0, mb)
    hit = finder.origin()
    if hit is not None and hit.made == "nan" and saved != "nan" and finder.first is hit:
        # a NaN made first that the node did not save (0/0 in padded steps the packing
        # drops): the infinity it saved was made later, by the op to blame
        finder = find_op_in_call(runner, "", 0, mb, passed_kinds=("nan",))
        hit = finder.first
    if hit is None and in_loss:  # (a loss op's -inf, masked in the loss; a NaN it capped:
        found = made_in_loss(runner, mb)  # a pair energy's inf - inf under a where)
        if found is None or (saved == "nan" and _own(node, found[0])):
            return None
        found[1].hint = exp_overflow_hint(runner, self_pair_hint(  # (PPO's ratio: replay.fill_ratio)
            found[1].hint, found[1].name, found[0]), found[1].name, found[0])
        return found[0], found[1], False
    if hit is None or hit.intentional or not (hit.inputs_finite or hit.from_mask) \
            or (hit.made == "nan" and saved != "nan") or _own(node, hit):
        return None
    cause = classify(runner, "forward", ("", 0, mb), hit=hit)
    cause.hint = raw_pole_hint(finder.lineage and finder.lineage.raw, cause.name, hit) or \
        self_pair_hint(cause.hint, cause.name, hit)
    # (a training set's std kept as a buffer, 0 for a variable constant there: its infinity
    # went on into a gate that saturated; every sample divides by it, no mask is the fix)
    bufs = [*runner.model.named_buffers(), *loss_buffers(runner.step.loss_fn)]
    held = held_divisor_hint(cause.hint, cause.name, finder, hit, bufs)
    cause.hint = held or cause.hint
    return hit, cause, held is not None


def _own(node: str | None, hit) -> bool:
    """Whether ``hit`` is backward ``node``'s own op (its cause describes it)."""
    own = re.fullmatch(r"(\w+?)Backward\d*", node or "")
    return bool(own) and own.group(1).lower() == hit.op.rpartition(".")[2].strip("_").lower()


def node_hints(b, cause) -> str:
    """``cause``'s hint for backward origin ``b``, worded by what its node saved (a pole, an
    exp's huge factor, a fractional power at 0, an exp's 0 with an exponent form)."""
    for worded in (pole_hint, exp_factor_hint, fractional_power_hint, exp_form_hint):
        cause.hint = worded(b, cause)
    return cause.hint


def _exp_parameter(model, leaf) -> str | None:
    """What to do when the underflowed value is the exp of a learned parameter (a Gaussian
    policy's ``log_std`` drifting down): the fix is to that parameter, not to the formula."""
    name = next((n for n, p in model.named_parameters() if p is leaf), None) \
        if leaf is not None else None
    if name is None:
        return None
    lo = float(leaf.detach().min())
    return (f"that value is the exp of the parameter {name} (as low as {lo:.4g}), which "
            f"drifted down until its exp underflowed: bound it where it is used "
            f"({name}.clamp(min=-20), as SAC bounds its log_std) and check what drives it "
            "down (an entropy bonus of the wrong sign, its learning rate)")


def backward_fields(b) -> dict[str, Any]:
    """The origin fields of the backward node :func:`find_backward_origin` found."""
    fields = origin_fields(
        phase="backward", module=b.module, op=b.node, source=b.source, params=b.params,
        param=(b.params or [None])[0], made=b.made, samples=b.samples,
        micro_batch=b.micro_batch, call=b.call, anomaly_node=b.anomaly_node,
        dtype=str(b.dtype).removeprefix("torch.") if b.dtype is not None else None,
        chain=[{"op": b.node, "made": b.made, "source": b.source}] if b.node else [])
    if b.summed:  # (no node made it: the engine's sum of its value's gradients did)
        fields["detail"] = summed_grads.detail(b.made, b.node, b.summed, b.module)
    if b.masked:  # (the forward dropped the op's value where the node made NaN)
        fields["masked"] = True
        if b.flat_by:  # (no mask: abs's derivative at 0, relu's, sent the 0)
            fields["masked_by"] = b.flat_by
    if b.called_from and b.called_from != b.source:  # (its line is an installed package's)
        fields["called_from"] = b.called_from
    return hook_fields(b, fields) if b.hook is not None else fields


def report_dropped_nan(report, runner: Runner) -> dict[str, Any]:
    """Anomaly mode stopped the recorded backward at a node's NaN, and the re-run, without
    anomaly mode, gives every parameter a finite gradient (see :mod:`replay.anomaly_stop`).
    The node is named; a NaN it made at its derivative's pole (an input exactly 0) is
    ``invalid``, as exact arithmetic makes it."""
    b = backward_origin(runner)
    origin = backward_fields(b)
    at_pole = b.node is not None and b.saved_zero == "0"
    report = finish(report, origin, "invalid" if at_pole else None, reproduced=b.node is not None,
                    hint=(f"{b.node} made NaN at its derivative's pole (an input exactly 0); "
                          + DO["backward_pole"]) if at_pole else
                    None if b.node is not None else UNSEEN_HINT)
    report["problems"].append(anomaly_note(b.node is not None))
    return report


def report_loss_backward(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The re-run loss_fn's own backward made the non-finite gradient entering the model's
    output (sqrt or a norm at 0 where a mask then multiplies by 0), which the model's backward
    dropped (a masked_fill): that loss node is the origin. None when no loss node made one (the
    value came from loss terms outside loss_fn: see replay.outside)."""
    b = backward_origin(runner)
    if b.node is None or b.module != "<loss>":
        return None
    report = report_backward(report, runner, b)
    if not b.params:
        report["problems"].append(finite_params_note(
            step, b.micro_batch, "the gradient entering the model's output"))
    return report


def backward_origin(runner: Runner):
    """:func:`find_backward_origin` with the samples of the micro-batch its node ran in: a
    later one's rows are its own (a graph batch's batch vector, other atom counts than the
    first's), found again with them when the first micro-batch's named none."""
    b = find_backward_origin(runner, samples(runner.step))
    if b.micro_batch and not b.samples and b.hook is None:
        b = find_backward_origin(runner, samples(runner.step, b.micro_batch))
    return b


def report_backward(report, runner: Runner, b=None) -> dict[str, Any]:
    b = b or backward_origin(runner)
    origin = backward_fields(b)
    reproduced = runner.step.event.get("phase") == "backward"
    if (came := saved_input(runner.step, b.node, b.saved)) is not None:  # no pole: the data's
        origin["samples"] = origin["samples"] or came[0]
        return finish(report, origin, "input", reproduced=reproduced, hint=came[1])
    maker = None if b.saved is None else \
        _saved_value_maker(runner, b.micro_batch or 0, b.node, b.saved, b.module == "<loss>")
    if maker is not None:
        hit, cause, held = maker
        origin["samples"] = origin["samples"] or hit.rows or []
        origin["chain"] = [hit.as_json(), *origin["chain"]]
        hint = (f"{b.node} multiplied a {label(b.saved)} it saved in the forward, made by "
                f"{hit.op} at {hit.source} and carried without a non-finite output "
                f"(saturated, masked or dropped); there: {cause.hint}")
        hint = hint if held else with_masked_pole(hint, hit.op, hit.made, cause.name,
                                                  b.node or "")
        return finish(report, origin, cause.name, reproduced=reproduced, hint=hint)
    if b.saved == "nan" and allowed_nan_held(runner.step):
        # no op made it: a missing value of an allow_nan input, masked after it was used
        came = input_origin(runner.step)
        origin["samples"] = came["samples"]
        return finish(report, origin, "input", reproduced=reproduced, hint=ALLOWED_NAN_SAVED
                      .format(node=b.node, tensor=came["tensor"], rows=came["samples"]))
    cause = classify(runner, "backward", node=b.node, saved=b.saved, at_pole=b.saved_zero,
                     underflowed=b.positive_input, inner=b.inner_op, dtype=b.dtype,
                     hit=b.hook.op if b.hook is not None else None, edge=b.edge_input)
    cause = recause(cause, b.node, b.copied, dict(runner.model.named_parameters()))
    cause = below_one.recause(cause, b.node, b.complement, b.saved_zero)
    cause.hint = node_hints(b, cause)
    cause.hint = looked_up_divisor_hint(runner, b, cause) or cause.hint  # (alphas_cumprod[t])
    cause = steep_power_cause(b, cause)
    cause = upstream_cause(runner, b.node, cause)  # (the loss's scale: DPO's beta)
    cause.hint = twice_hint(b, cause.hint)
    cause.hint = zero_start_hint(runner, b, cause.name, cause.hint)  # (an STN's theta = I)
    cause.hint = hook_hint(b, cause.hint) if b.hook is not None else cause.hint
    if cause.name == "underflow" and (said := _exp_parameter(runner.model, b.exp_of)):
        cause.hint = f"{cause.hint}; {said}"
    note_grad_rows(report, runner.step, b, origin)  # (a passage encoder's, beside the queries)
    report = finish(report, origin, cause.name, reproduced=reproduced, hint=cause.hint)
    if b.hook is None and not b.summed:  # (the same pole elsewhere: the head's and the tail's)
        add_others(report, runner, samples(runner.step), b.node, b.source)
    through_time.explain(report, runner, b.node, b.source, b.summed)  # (a rollout's)
    if b.inner_op:  # a hand-written backward: the bug is in its formula, not the forward
        path, _, line = b.inner_source.rpartition(":")
        text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
        report["problems"].append(
            f"{b.node} is a custom autograd.Function's backward: its own code made the "
            f"{b.made}, {b.inner_op} at {b.inner_source}" + (f" ({text})" if text else "")
            + "; fix that formula at this input (its limit's value there, torch.where on a "
            "safe input, an eps)")
    return report
