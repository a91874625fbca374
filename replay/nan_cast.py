"""Where a NaN that came in with the batch went, when nothing after it went non-finite: a cast
of NaN to an integer type.

A frustum's or a point cloud's coordinates made NaN by a missing calibration record (a
camera's NaN intrinsics through ``inverse(K)``) or by a LiDAR's NaN returns, voxelised by
``((p - lower) / size).long()``: a cast of NaN to an integer is undefined (INT64_MIN on x86),
the range check that follows drops those points, and the model's outputs, loss and gradients
stay finite: the input event's hint said the model may impute the NaN on purpose. It did not:
those points were lost in silence (a camera's whole view). One forward re-run finds the first
op that cast a floating value holding NaN to an integer type, and its line.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import TorchDispatchMode
from .dispatch import run_op
from .rerun import Runner
from .source import user_source

_CASTS = {"_to_copy", "to", "copy_", "_to_dim_order_copy"}


class _Casts(TorchDispatchMode):
    """``found``: (line, integer dtype) of the first cast of a NaN-holding float to an
    integer type."""

    def __init__(self):
        super().__init__()
        self.found: tuple[str | None, torch.dtype] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = run_op(func, args, kwargs or {})
        name = func.overloadpacket.__name__
        if self.found is None and name in _CASTS and isinstance(out, torch.Tensor) \
                and not out.is_floating_point() and not out.is_complex() \
                and out.dtype != torch.bool:
            src = args[1] if name == "copy_" else args[0]
            if isinstance(src, torch.Tensor) and src.is_floating_point() \
                    and bool(torch.isnan(src).any()):
                self.found = (user_source(), out.dtype)
        return out


def nan_cast_hint(report: dict[str, Any], step) -> None:
    """An input event's hint, whose NaN the model's outputs, loss and gradients did not carry
    (the recorder's ``nan_handled``: it advised ``allow_nan`` for a model that imputes it), in
    place: the line where the forward cast that NaN to an integer type (see the module); as it
    is when none did or the re-run fails."""
    hint = report.get("hint")
    if report.get("cause") != "input" or not step.event.get("nan_handled") or not hint \
            or step.model is None:
        return
    casts = _Casts()
    try:
        Runner(step).run(backward=False, instrument=False, forward_ctx=lambda: casts)
    except Exception:  # (the hint as it is: this only says where the NaN went)
        return
    if casts.found is None:
        return
    line, dtype = casts.found
    kind = str(dtype).removeprefix("torch.")
    report["hint"] = ("the model's outputs, loss and gradients stayed finite, but not because "
                      f"it imputed the NaN: the forward cast it to {kind} at {line} "
            "(a float-to-integer cast of NaN is undefined: an arbitrary index, INT64_MIN on "
            "x86), so the values computed from it (grid or voxel indices of points made of NaN "
            "coordinates, a camera's frustum through NaN intrinsics) were dropped or misplaced "
            "in silence: fix or filter these samples' NaN where the data is made, or drop "
            "non-finite points (torch.isfinite(p).all(-1)) before the cast")
