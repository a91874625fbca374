"""An overflow (or underflow) whose data, not the op nor the training, is out of scale.

Two readings of the bundle say so. Samples whose recorded data (an input, a loss target) is 10x
larger than every other row's (:mod:`replay.outliers`): a record in the wrong unit. Or, where
no row stands out (a tensor without a batch dimension: a hypernetwork's task descriptor, one
condition for every sample; a whole batch in the wrong unit), every layer's absmax jumping
at the event's own step from the first layer that takes the batch, with no learning-rate,
gradient or weight jump before it (the precursor :data:`replay.precursors.INPUT_JUMP`): the
step was fed other data. An underflow's samples may stand 10x below every other row instead
(a record in volts among microvolts, whose squares float16 rounds to 0). Either way the op's own remedies (clamp it, a wider type, a lower
learning rate) would hide the data's fault: the hint says so. So would a ridge for a
decomposition singular on those samples' matrices alone (a learned noise whose softplus of
such a record is 0).
"""

from __future__ import annotations

import re
from typing import Any

from .batch_overflow import without_advice
from .carried_state import carried_keys, carried_note
from .drop import undroppable
from .grown_input import grown_input_note
from .load import Step
from .outlier_columns import outlier_column, outlier_column_hint
from .outliers import (
    input_rows_hint,
    out_of_scale,
    outlier_hint,
    outlier_input_rows,
    undersized_hint,
    undersized_input,
)
from .precursors import INPUT_JUMP
from .unread_data import loss_only_keys
from .whatif import run_tries
from .zero_filled_column import zero_filled_column, zero_filled_column_hint


def data_scale_hint(report: dict[str, Any], step: Step) -> None:
    """Append to an overflow's (or underflow's: exp of a huge negative score) hint that its
    data is out of scale, when the bundle shows it."""
    o = report["origin"]
    if _singular_of_outliers(report, step):
        return
    if report.get("cause") not in ("overflow", "underflow") or not report.get("hint"):
        return
    found = out_of_scale(step, o)
    if found is not None and not _drop_would_clear(step, report, found[0]):
        found = None  # (rows that stand out in data the op never read: the rest overflow too)
    if found is not None and not o.get("samples") and step.event.get("statistic"):
        o["samples"] = found[0]  # (a running statistic has no rows: the batch's that made it)
    if found is not None and (grown := grown_input_note(report, *found)):
        report["hint"] = f"{report['hint']}. But {grown}"
    elif found is not None and (zeros := zero_filled_column(
            step, o.get("micro_batch") or 0, found[1]["key"], found[0])) is not None:
        hint = without_advice(report["hint"])  # (a column's unit, no records to drop)
        report["hint"] = f"{hint}. But {zero_filled_column_hint(zeros, found[0])}"
    elif found is not None:
        droppable = undroppable(step, o.get("micro_batch") or 0) is None
        hint = without_advice(report["hint"])  # (the outlier sentence says the rest)
        report["hint"] = f"{hint}. But {outlier_hint(found[1], found[0], droppable)}"
    elif report["cause"] == "overflow" and (column := outlier_column(
            step, o.get("micro_batch") or 0, o.get("samples") or [],
            skip=loss_only_keys(step, o))) is not None:
        hint = without_advice(report["hint"])  # (a table's feature: one column stands out)
        report["hint"] = f"{hint}. But {outlier_column_hint(column, o['samples'])}"
    elif report["cause"] == "underflow" and (small := undersized_input(
            step, o.get("micro_batch") or 0, o.get("samples") or [])) is not None:
        droppable = undroppable(step, o.get("micro_batch") or 0) is None
        report["hint"] = f"{report['hint']}. But {undersized_hint(small, o['samples'], droppable)}"
    elif (rows := outlier_input_rows(step, o)) is not None:  # (a query grid beside the batch)
        report["hint"] = f"{report['hint']}. But {input_rows_hint(rows)}"
    elif report["cause"] == "overflow" and (note := carried_note(
            step, o, carried_keys(step, o.get("micro_batch") or 0))) is not None:
        report["hint"] = f"{report['hint']}. But {note}"
    elif (ratio := _input_jump(report)) is not None:
        report["hint"] = (
            f"{report['hint']}. But the data fed to this step is out of scale: "
            f"{INPUT_JUMP} {ratio}x at this very step, and every layer's with it (see "
            "precursors), with no jump of the learning rate, gradients or weights before it "
            "(a wrong unit, a condition or task descriptor not normalised as in the other "
            "steps, a corrupt batch), which neither a lower learning rate nor a wider type "
            "fixes; check what the loop passed to the model at this step")


def _drop_would_clear(step: Step, report: dict[str, Any], rows: list[int]) -> bool:
    """Whether the step re-run without ``rows``, found out of scale among the rows of an
    origin that spans the whole batch (an op that mixes the samples, :func:`outlier_rows`),
    comes back finite, or cannot tell. A batch whose every row overflowed alike may hold
    rows that stand out in data the op never read (a q-error's true cardinalities, spanning
    decades by design, beside ``exp`` of a float16 prediction): the event coming back
    without them says those rows are not what overflowed; one of another kind (a NaN where
    the origin made an infinity: a group's mean left with no record) says the overflow went
    with them. An origin of those samples alone is not re-run: its own rows say it."""
    o = report["origin"]
    if not o.get("all_samples") and o.get("samples"):
        return True
    tried = run_tries(step, report, ["drop=" + ",".join(str(r) for r in rows)])
    first = tried[0] if tried else {}
    back = (first.get("origin") or {}).get("kind")
    return first.get("finite") is not False or bool(first.get("inconclusive")) \
        or (back is not None and (back == "nan") != (o.get("made") == "nan"))


def _singular_of_outliers(report: dict[str, Any], step: Step) -> bool:
    """A decomposition singular in float64 too on some samples' matrices only, whose data is
    out of scale (a Kalman filter's R = softplus(w * c) of a signal logged in mW: 0 there):
    the records, not a missing ridge, made those matrices singular. True when said."""
    o = report["origin"]
    if o.get("made") != "LinAlgError" or report.get("cause") != "invalid" \
            or not o.get("samples") or o.get("all_samples") or not report.get("hint"):
        return False
    found = out_of_scale(step, o)
    if found is None:
        return False
    droppable = undroppable(step, o.get("micro_batch") or 0) is None
    report["hint"] = (f"{report['hint']}. But only these samples' matrices failed, and "
                      f"{outlier_hint(found[1], found[0], droppable)}; a ridge would hide "
                      "them as well")
    return True


def _input_jump(report: dict[str, Any]) -> str | None:
    """The ratio of the input batch's absmax jump at the event's step, None without one."""
    at = report["event"].get("step")
    for p in report.get("precursors") or []:
        m = re.match(re.escape(INPUT_JUMP) + r" (\S+)x", p.get("detail") or "")
        if m and p.get("kind") == "absmax_jump" and at is not None and p.get("step") == at:
            return m.group(1)
    return None
