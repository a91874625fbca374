"""An ``input`` event on a root input that ``allow_nan`` names, where the model's own code made
the NaN from the values it imputed: the recorder saw NaN leave the model while that input held
missing values and no module call made it (a masked mean over a series with no observed step,
``(h * obs).sum(1) / obs.sum(1)`` in the root's ``forward``: 0/0), which reads as a NaN that got
past the imputation. The op finder over the root call tells them apart: a NaN made from NaN-free
inputs is the model's (that op is the origin), a missing value passed on is not."""

from __future__ import annotations

from typing import Any

from recorder.capture import output_leaves
from recorder.finite import has_nan
from recorder.missing import root_input_name

from .cause import classify
from .empty_mask import made_by_the_loss
from .findings import finish, origin_fields
from .forward import find_op_in_call
from .input_text import ALLOWED_NAN_GOT_PAST
from .leaked_input import leaking_input
from .load import Step
from .masked_product import masked_hint
from .recorded import nan_allowed, origin_key
from .rerun import Runner

# the input the re-run found leaking, where the recorder named the first one holding NaN
LEAKED = ("the recorder named {named}, the first allow_nan input holding NaN; the re-run's "
          "outputs come out NaN-free once {tensor}'s NaN are set to 0, and not once {named}'s "
          "are: {tensor}'s got past the model's handling")

# made_from_imputed's answer when the re-run's model left no NaN: re-run the step instead
RERUN: dict[str, Any] = {}


def _nan_left(runner: Runner, mb: int) -> bool:
    """The re-run's forward of micro-batch ``mb`` put out a NaN (or could not say)."""
    try:
        run = runner.run(backward=False, instrument=False)
        return any(has_nan(t) for t in output_leaves(run.objects[mb])  # (a Distribution's too)
                   if t.is_floating_point())
    except Exception:  # (the input origin stands)
        return True


def made_from_imputed(report, step: Step, origin: dict[str, Any]) -> dict[str, Any] | None:
    """The report of the op that made the NaN of an ``allow_nan`` input event from NaN-free
    values, when the re-run finds one; None otherwise (the NaN got past the handling)."""
    if made_by_the_loss(report, step, origin):  # (a masked loss's 0/0 over missing targets alone)
        return RERUN
    _, raw = origin_key(step, origin)
    if step.model is None or step.event.get("nan_handled") or not raw \
            or not nan_allowed(step, root_input_name(raw)):
        return None
    mb = origin.get("micro_batch") or 0
    runner = Runner(step)
    try:
        finder = find_op_in_call(runner, "", 0, mb)
    except Exception:  # the input origin stands without the re-run
        return None
    hit = finder.origin()
    if finder.first_nan is None and not _nan_left(runner, mb):
        # the rebuilt model imputes every missing value: the NaN does not come back from
        # the bundle's batch alone, so the step is re-run as any other (the fidelity check)
        return RERUN
    if finder.first_nan is None and (leaked := leaking_input(
            step, origin, lambda m: _nan_left(runner, m))):
        report["problems"].append(LEAKED.format(named=origin.get("tensor"), **leaked))
        origin.update(leaked)  # (the caller's input origin: the input that leaked)
    if finder.first_nan is None and finder.masked_nan is not None:  # (nan * mask)
        leaked = ALLOWED_NAN_GOT_PAST.format(tensor=origin.get("tensor"))
        kept = masked_hint(origin, finder.masked_nan, finder.masked_by_mask)
        return finish(report, origin, "input", reproduced=True, hint=leaked + kept)
    if finder.first_nan is None or hit is None:
        return None
    module, call = hit.within or ("", 0)
    cause = classify(runner, "forward", ("", 0, mb), hit=hit)
    report["problems"].append(
        f"the recorder saw NaN leave the model while {origin.get('tensor')} held missing "
        "values (allow_nan) and no module call made it, which reads as a missing value that "
        f"got past the imputation; the re-run finds that the model's own code made it from "
        f"NaN-free values: {hit.op} at {hit.source}")
    o = origin_fields(phase="forward", module=module, call=call, micro_batch=mb, op=hit.op,
                      source=hit.source, chain=finder.chain(), samples=hit.rows or [],
                      made=hit.made, inputs_finite=True)
    return finish(report, o, cause.name, reproduced=True, hint=cause.hint)
