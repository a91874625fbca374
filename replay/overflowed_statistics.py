"""A note for a norm layer's running statistic that was already non-finite as the step began.

One outlier batch (a corrupt record of 1e20) makes BatchNorm's batch variance overflow float32
(its square is above the type's max), and the layer writes +inf into ``running_var``. Training
mode normalises by each batch's own statistics, so the loss stays finite; the recorder checks
the statistics as each recorded training step closes (recorder.running_stats), so a bundle
holds one non-finite as its step began only where that batch ran unrecorded. Eval mode
normalises by the running statistics, so validation and the saved checkpoint are wrong from
then on (the layer outputs its bias alone in those channels, NaN where ``running_mean`` is not
finite). When a later event's bundle holds such a statistic, and the report does not already
name it, the note says so, and which recorded step's activations were large enough to overflow
a variance: the likely batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.finite import finite, kind_of, label
from recorder.running_stats import named_running_statistics

from .findings import finish, origin_fields
from .load import Step

__all__ = ["statistics_note", "statistic_came_in", "written_statistic_note"]


def statistics_note(step: Step, report: dict[str, Any]) -> str | None:
    """The note on the norm layers' running statistics non-finite in the bundle's buffers
    (as the step began), unless the report names them already; else None."""
    said = " ".join([*(report["origin"].get("params") or ()), report.get("hint") or "",
                     *report.get("problems", ())])
    bad = {n: t for n, t in _bad_statistics(step).items() if n not in said}
    return _held_text(bad, report) if bad else None


def _held_text(bad: dict[str, torch.Tensor], report: dict[str, Any]) -> str:
    """What the statistics ``bad`` (name -> the bundle's pre-step copy) held as the step began,
    why no check saw them, what eval mode does with them, and the recorded step whose
    activations could overflow them (``report``'s history)."""
    names = list(bad)
    kinds = "/".join(sorted({label(kind_of(t)) for t in bad.values()}))
    where = ", ".join(f"{n} ({int((~torch.isfinite(t)).sum())} of {t.numel()} entries)"
                      for n, t in list(bad.items())[:4]) + (" ..." if len(bad) > 4 else "")
    began = report["event"].get("step")
    dtype = next(iter(bad.values())).dtype
    return (f"{where} held {kinds} as step {began} began: a running statistic an earlier "
            "training step's batch overflowed (a variance of values above "
            f"{_root_max(dtype):.3g} is +inf in {str(dtype).removeprefix('torch.')}) before "
            "the recorder checked it (it checks them as each training step it records "
            "closes: a step before the recorder attached, or one of a copy of the model, a "
            "checkpoint); training mode normalises by each batch's own statistics, so the loss "
            "stayed finite, but eval mode normalises by these: model.eval() outputs of "
            f"{_owners(names)} are wrong in those channels (its bias alone; NaN where the "
            f"running mean is not finite){_overflow_step(report, dtype, began)}; filter or clip "
            "that data, then reset_running_stats() and refill them over clean batches, or "
            "resume from a checkpoint before it")


def _bad_statistics(step: Step) -> dict[str, torch.Tensor]:
    """name -> the bundle's pre-step copy, of the norm layers' floating buffers that hold a
    non-finite value (a rebuilt model says which layers are norm layers)."""
    if step.model is None:
        return {}
    out = {}
    for mname, mod in step.model.named_modules():
        for bname, _ in named_running_statistics(mod):
            name = f"{mname}.{bname}" if mname else bname
            t = step.tensors.get(f"buffers/{name}")
            if t is not None and not finite(t):
                out[name] = t
    return out


def _owners(names: list[str]) -> str:
    """The layers owning the statistics ``names``."""
    owners = list(dict.fromkeys(n.rpartition(".")[0] or "<root>" for n in names))
    return ", ".join(owners[:4]) + (" ..." if len(owners) > 4 else "")


def _root_max(dtype: torch.dtype) -> float:
    """The smallest magnitude whose square overflows ``dtype``."""
    return math.sqrt(torch.finfo(dtype).max)


def _overflow_step(report: dict[str, Any], dtype: torch.dtype, began) -> str:
    """Where the recorded history first shows a layer's absmax whose square overflows the
    statistic's type, before the event step: that step's batch, and the first layer called
    that shows it; empty when the history shows none."""
    hist = report.get("history") or {}
    edge, layers = _root_max(dtype), hist.get("layers") or []
    order = hist.get("call_order") or list(range(len(layers)))
    for s, row in zip(hist.get("steps") or (), hist.get("absmax") or ()):
        if began is not None and s >= began:
            break
        hit = next((li for li in order if li < len(row) and row[li] is not None
                    and not math.isnan(row[li]) and row[li] >= edge), None)
        if hit is not None:
            return (f"; the recorded history's first such values came at step {s}: absmax "
                    f"{row[hit]:.3g} in {layers[hit] or '<root>'} (the first layer called to "
                    "show one), that step's batch is the likely one")
    return ""


def written_statistic_note(step: Step, report: dict[str, Any]) -> str | None:
    """The note of an event the recorder found in a running statistic the step's forward
    wrote (``event.statistic``, recorder.running_stats), when the re-run made it again."""
    name = step.event.get("statistic")
    if not name or not report.get("reproduced") or step.event.get("inputs_finite") is False:
        return None
    return (f"{name} is what went non-finite: the layer's output, the loss and the gradients "
            "stayed finite (train mode normalises with the batch's own statistics), but "
            "model.eval(), every validation and every checkpoint from this step on use it; "
            "once the data is fixed, reset the layer's statistics (reset_running_stats()) or "
            "resume from a checkpoint saved before this step")


def statistic_came_in(report: dict[str, Any], step: Step) -> dict[str, Any] | None:
    """The report of an event the recorder found in a running statistic that was already
    non-finite as the step began (the recorder attached after the batch that overflowed it,
    or a checkpoint held it): decided by the bundle, as non-finite weights are; else None."""
    name, ev = step.event.get("statistic"), step.event
    t = step.tensors.get(f"buffers/{name}") if name else None
    if t is None or ev.get("inputs_finite") is not False or finite(t):
        return None
    o = origin_fields(phase="forward", module=name.rpartition(".")[0], call=ev.get("call"),
                      micro_batch=ev.get("micro_batch"), params=[name], param=name,
                      made=kind_of(t), inputs_finite=False)
    # (the report's own history: the step whose activations could overflow it)
    return finish(report, o, "weights", reproduced=True,
                  hint=_held_text(_bad_statistics(step), report))
