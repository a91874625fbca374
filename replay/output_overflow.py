"""A loss op that overflowed on a model output already near its type's range: the forward, not
the loss, left the scale.

A finite-difference wave simulation time-stepped with a ``dt`` above its CFL limit grows its
wavefield about 5x a step; over a short record it stays finite, but the traces it returns are
1e35 where the observed ones are 1e-2, and ``mse_loss`` squares them past float32. The
overflow's generic advice (subtract the row max before exp, normalise before a sum, float64)
points at the loss, which only squared what it was given. When the model's output the loss
took holds values whose square overflows the type, and the loss's data are orders of magnitude
smaller, the hint says so and names the module whose output first held such values (from a
forward re-run's module calls), with what makes a forward grow that far.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .cause_text import DO
from .load import Step
from .rerun import Runner

_GENERIC = (DO["wider64_exp"], DO["wider64"])
SCALE = 1e6  # the least ratio of the output's largest magnitude to the loss data's


def _absmax(ts) -> float:
    vals = [float(t.detach().abs().max()) for t in ts
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return max(vals) if vals else 0.0


def _data_absmax(step: Step, mb: int) -> float | None:
    """The largest finite magnitude of the loss's data arguments (not the model's output)."""
    entry = step.micro_batches[mb]
    made = set(entry.get("loss_grad_args") or ())
    vals = [float(t.detach().abs().max()) for k in (entry.get("loss_paths") or {})
            if k not in made and isinstance(t := step.tensors.get(k), torch.Tensor)
            and t.is_floating_point() and t.numel() and bool(torch.isfinite(t).all())]
    return max(vals) if vals else None


def huge_output_hint(report: dict[str, Any], step: Step) -> None:
    """Replace a loss overflow's generic advice when the model output it took was already
    beyond the square root of its type's largest value and :data:`SCALE` times the loss
    data's largest magnitude."""
    o, hint = report["origin"], report.get("hint") or ""
    if report.get("cause") != "overflow" or o.get("phase") != "loss" \
            or o.get("module") != "<loss>" or not hint.endswith(_GENERIC) \
            or step.model is None:
        return
    mb = o.get("micro_batch") or 0
    data = _data_absmax(step, mb) if mb < len(step.micro_batches) else None
    try:
        run = Runner(step).run(backward=False)  # (instrumented: its module calls' sizes)
        out = run.outputs[mb] if mb < len(run.outputs) else []
    except Exception:  # (the overflow's own advice stands)
        return
    big = _absmax(out)
    floats = [t.dtype for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats or not math.isfinite(big) or big < math.sqrt(torch.finfo(floats[0]).max) \
            or (data is not None and big < SCALE * max(data, 1e-30)):
        return
    first = next((c for c in run.calls if c.micro_batch == mb and c.outputs_finite
                  and (m := _call_absmax(c)) is not None and m >= big / 10), None)
    who = f"{first.module or '<root>'}'s output (call {first.call})" if first else \
        "the model's output"
    than = f", where the loss's data are at most {data:.3g}" if data is not None else ""
    tail = next(t for t in _GENERIC if hint.endswith(t))
    report["hint"] = hint[:-len(tail)].rstrip().rstrip(":") + (
        f"; but the model's output it took already held values up to {big:.3g}{than}: the "
        "loss only squared or summed them past the type's range, the forward had left the "
        f"scale, and {who} was the first to hold them. Look there, not at the loss: a "
        "time-stepping loop past its stability limit (an explicit scheme's dt above the CFL "
        "bound, v_max dt / dx ≤ 1/√2 for a 2-D wave equation's 5-point stencil), an unstable "
        "recurrence, or weights an update blew up (see the precursors); a wider type only "
        "postpones it")


def _call_absmax(c) -> float | None:
    vals = [abs(float(v)) for pair in c.minmax for v in pair]
    return max(vals) if vals and all(math.isfinite(v) for v in vals) else None
