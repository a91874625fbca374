"""A step the model's own numeric check ended (the recorder's ``"check"`` event, see
:mod:`recorder.numeric_check`): ``raise ValueError("NaN in attention weights")`` after a
softmax, ``assert torch.isfinite(x).all()``, an ODE solver's assertion. The re-run raises the
same error; the op finder, over the root's call, names the op that made the first non-finite
value before it, classified as any forward origin; for a check on a gradient (a tensor hook
raising in backward), the node that made the first non-finite gradient, as any backward origin.
When every value was finite up to the raise
(a step size that underflowed, a threshold the check tests), the report says so and names the
line that raised."""

from __future__ import annotations

from typing import Any

from recorder.errors import first_line
from recorder.numeric_check import check_reason

from .backward_report import backward_origin, report_backward
from .cause import classify
from .findings import finish, origin_fields
from .forward import find_op_in_call
from .load import Step
from .loss_check import first_in_loss
from .rerun import Runner
from .source import raised_at


def report_check(report, step: Step, runner: Runner, run) -> dict[str, Any] | None:
    """The report of a re-run that the code's own check on a non-finite value ended; None
    when ``run`` ended otherwise."""
    exc = run.error
    if exc is None or check_reason(exc) is None:
        return None
    mb, source = runner.micro_batch, raised_at(exc)
    first = first_line(exc, 160)
    said = f"the step's code raised {type(exc).__name__}" + (f" ({first})" if first else "") \
        + f" at {source}"
    if step.event.get("phase") == "backward" \
            and (b := backward_origin(runner)).node is not None:  # (a gradient's check: a hook)
        report["problems"].append(f"{said}, on the {b.made} gradient that {b.node} made")
        return report_backward(report, runner, b)
    finder = find_op_in_call(runner, "", 0, mb)
    if (hit := finder.origin()) is not None:  # the value it refused: made by an op before it
        module, call = hit.within or ("", 0)
        cause = classify(runner, "forward", until=(module, call, mb), hit=hit)
        origin = origin_fields(phase="loss" if module == "<loss>" else "forward",
                               module=module, call=call, micro_batch=mb, op=hit.op,
                               made=hit.made, source=hit.source or source,
                               samples=hit.rows or [], inputs_finite=True)
        report["problems"].append(f"{said}, on the {hit.made} that {hit.op} made")
        return finish(report, origin, cause.name, reproduced=True, hint=cause.hint)
    if (hit := first_in_loss(step, mb)) is not None:  # (the loss's own check raised)
        cause = classify(runner, "loss", hit=hit, micro_batch=mb)
        origin = origin_fields(phase="loss", module="<loss>", micro_batch=mb, op=hit.op,
                               made=hit.made, source=hit.source or source,
                               samples=hit.rows or [], inputs_finite=True)
        report["problems"].append(f"{said}, on the {hit.made} that {hit.op} made in the loss")
        return finish(report, origin, cause.name, reproduced=True, hint=cause.hint)
    origin = origin_fields(phase="forward", micro_batch=mb, source=source, made=None)
    report["problems"].append(f"{said}, with every value of the step finite up to there")
    return finish(report, origin, None, reproduced=True, hint=(
        "no value was non-finite when the check raised: it refused a finite one (an adaptive "
        "solver's step size that underflowed on stiff or exploding dynamics, a threshold it "
        f"tests); read the check at {source} and the values it tests"))
