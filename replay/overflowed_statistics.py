"""A note for a norm layer's running statistic that was already non-finite as the step began.

One outlier batch (a corrupt record of 1e20) makes BatchNorm's batch variance overflow float32
(its square is above the type's max), and the layer writes +inf into ``running_var``. Training
mode normalises by each batch's own statistics, so the loss stays finite and no check fires:
the recorder checks a buffer only where it is passed to a module as an input. Eval mode
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

from recorder.compat import is_norm_layer
from recorder.finite import finite, kind_of, label

from .load import Step

__all__ = ["statistics_note"]


def statistics_note(step: Step, report: dict[str, Any]) -> str | None:
    """The note on the norm layers' running statistics non-finite in the bundle's buffers
    (as the step began), unless the report names them already; else None."""
    bad = _bad_statistics(step)
    said = " ".join([*(report["origin"].get("params") or ()), report.get("hint") or "",
                     *report.get("problems", ())])
    bad = {n: t for n, t in bad.items() if n not in said}
    if not bad:
        return None
    names = list(bad)
    kinds = "/".join(sorted({label(kind_of(t)) for t in bad.values()}))
    where = ", ".join(f"{n} ({int((~torch.isfinite(t)).sum())} of {t.numel()} entries)"
                      for n, t in list(bad.items())[:4]) + (" ..." if len(bad) > 4 else "")
    began = report["event"].get("step")
    dtype = next(iter(bad.values())).dtype
    return (f"{where} held {kinds} as step {began} began: a running statistic an earlier "
            "training step's batch overflowed (a variance of values above "
            f"{_root_max(dtype):.3g} is +inf in {str(dtype).removeprefix('torch.')}), which no "
            "check sees, the recorder checking a buffer only where a module takes it as an "
            "input; training mode normalises by each batch's own statistics, so the loss "
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
        if not is_norm_layer(mod):
            continue
        for bname, b in mod.named_buffers(recurse=False):
            name = f"{mname}.{bname}" if mname else bname
            t = step.tensors.get(f"buffers/{name}")
            if b is not None and t is not None and t.is_floating_point() and not finite(t):
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
