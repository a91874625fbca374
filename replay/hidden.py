"""A loss or backward event the re-run does not make, while the forward makes a non-finite
value that no module output carries: a value the model keeps aside (an MoE layer's aux loss
in ``self.aux_loss``), which the loop adds to the loss outside ``loss_fn``. The replay re-runs
``loss_fn`` only, so the event does not come back; the op that made the value is still named.
"""

from __future__ import annotations

from typing import Any

from .cause import classify
from .findings import finish, origin_fields
from .forward import find_op_in_call
from .load import Step
from .rerun import Runner


def report_hidden_forward(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The report naming the first forward op (in any micro-batch) that made a non-finite
    value from finite inputs although every module output stayed finite; None when none did."""
    for mb in range(max(1, len(step.micro_batches))):
        hit = find_op_in_call(runner, "", 0, mb).origin()
        if hit is not None and hit.inputs_finite and not hit.intentional:
            break
    else:
        return None
    module, call = hit.within or ("", 0)
    phase = step.event.get("phase")
    origin = origin_fields(phase="forward", module=module, call=call, micro_batch=mb,
                           inputs_finite=True, made=hit.made, op=hit.op, source=hit.source,
                           samples=hit.rows or [], chain=[hit.as_json()],
                           input_range=[hit.input_min, hit.input_max])
    cause = classify(runner, "forward", until=("", 0, mb), hit=hit)
    rerun = ("the loss was given to record_loss, which the replay cannot re-run" if
             step.loss_fn is None else f"the recorded {phase} event did not come back in the "
             "re-run, whose loss_fn and backward are finite")
    report["problems"].append(
        f"{rerun}; but the forward made a {hit.made} ({hit.op} in {module or '<root>'}) that "
        "no module output carries: a value kept aside (an aux loss, a KL or log prior stored "
        "on the module) that the loop added to the loss outside loss_fn")
    hint = (f"{cause.hint}; return such a term from the model's forward or compute it inside "
            "loss_fn, so that the recorder checks it and the replay re-runs it"
            if cause.hint else None)
    return finish(report, origin, cause.name, reproduced=False, hint=hint)


def report_held_forward(report, step: Step, runner: Runner, mb: int) -> dict[str, Any] | None:
    """A loss event whose loss, re-run, is non-finite while no op of the loss made a
    non-finite value of finite inputs: it took one the forward made and kept aside, no
    module output (a forward hook's capture the loss module holds: an activation penalty
    ``out.pow(2).sum()`` stored by the hook, overflowed under float16 autocast). The report
    names that forward op and its line; None when no forward op made one."""
    hit = find_op_in_call(runner, "", 0, mb).origin()
    if hit is None or not hit.inputs_finite or hit.intentional:
        return None
    module, call = hit.within or ("", 0)
    origin = origin_fields(phase="forward", module=module, call=call, micro_batch=mb,
                           inputs_finite=True, made=hit.made, op=hit.op, source=hit.source,
                           samples=hit.rows or [], chain=[hit.as_json()],
                           input_range=[hit.input_min, hit.input_max])
    cause = classify(runner, "forward", until=("", 0, mb), hit=hit)
    report["problems"].append(
        f"the loss is non-finite, but no op of the loss made the value: it took a {hit.made} "
        f"that the forward made ({hit.op} in {module or '<root>'}) and no module output "
        "carries, a value kept aside (a forward hook's capture, an aux loss stored on a "
        "module) that loss_fn reads")
    return finish(report, origin, cause.name, reproduced=True, hint=cause.hint)
