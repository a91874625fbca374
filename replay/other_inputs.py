"""Other tensors of an input event's micro-batch that hold NaN/Inf in rows the origin does
not name. A sliding-window loader (METR-LA's ``x = series[i:i+T]``, ``y = series[i+T:i+T+H]``)
puts one bad reading in the inputs of some windows and in the targets of the windows before
them: the event names the first tensor's rows, and ``--try drop=`` of those alone still meets
the others. The note names each other tensor with its rows, and the union to drop."""

from __future__ import annotations

from typing import Any

from recorder.capture import batch_path, flatten_tree, loss_path
from recorder.finite import finite, has_nan
from recorder.missing import root_input_name

from .load import Step, micro_batch_inputs
from .recorded import nan_allowed, samples

OTHER_ROWS = ("the micro-batch holds NaN/Inf in other rows too: {others}; those records are "
              "bad as well (drop={union} removes every one)")


def other_inputs_note(report: dict[str, Any], step: Step) -> None:
    """Add the note to an input event's report whose origin names samples."""
    o = report.get("origin") or {}
    if report.get("cause") != "input" or o.get("phase") != "input" or not o.get("samples"):
        return
    i, named = o.get("micro_batch") or 0, set(o["samples"])
    if i >= len(step.micro_batches) or "inputs" not in step.micro_batches[i]:
        return
    others = {}
    for name, rows in _bad_rows(step, i):
        if name != o.get("tensor") and (extra := sorted(set(rows) - named)):
            others.setdefault(name, extra)
    if others:
        union = sorted(named.union(*others.values()))
        text = "; ".join(f"{name} in rows {rows}" for name, rows in others.items())
        report["problems"].append(OTHER_ROWS.format(others=text,
                                                    union=",".join(map(str, union))))


def _bad_rows(step: Step, i: int):
    """(name, rows) of micro-batch ``i``'s model inputs and data loss arguments holding NaN
    (a -inf mask alone is no bad record), outside those ``allow_nan`` names."""
    args, kwargs = micro_batch_inputs(step, i)
    _, tensors, paths = flatten_tree([list(args), kwargs], "x")
    rows = samples(step, i).rows
    for key, t in tensors.items():
        if t.is_floating_point() and has_nan(t) \
                and not nan_allowed(step, root_input_name(paths[key])):
            yield batch_path(paths[key], len(args)), rows(t)
    entry = step.micro_batches[i]
    derived = set(entry.get("loss_grad_args") or ())  # (made of the model's outputs: no data)
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if key not in derived and t is not None and t.is_floating_point() and not finite(t) and has_nan(t):
            yield loss_path(raw), rows(t)
