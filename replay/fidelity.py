"""Is the rebuilt model the recorded one? The re-run's per-call statistics against the ring's.

A factory cannot see run-time configuration (command-line flags, globals, config files), so it
may build a model other than the one that trained: same parameters, different computation.
Before anything is localised, the instrumented re-run's (min, max) of every module call is
compared with the recorded event step's, call by call (module, micro-batch, k-th call), up to
the first call the recorder saw non-finite (what follows it depends on the bad value). A call
whose values differ beyond float tolerance (1% relative on the recorded device), one missing
from the re-run, or a module the recorded model did not have means the factory built a
different model.

>>> fid = compare(step, run)                                   # doctest: +SKIP
>>> fid["matches"], fid["module"]
(False, 'scale')
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch

from .load import Step
from .rerun import Run

# Float tolerance (relative, absolute). The same device may still differ a little: thread
# counts reorder reductions, training may have run float32 matmuls as TF32 (about 1e-3
# relative); another device (a GPU bundle replayed with --device cpu) runs other kernels. A
# model built from other settings differs by far more.
SAME_DEVICE, OTHER_DEVICE, ABS = 1e-2, 5e-2, 1e-5


def compare(step: Step, run: Run) -> dict[str, Any] | None:
    """``{"matches": bool, "module", "call", "micro_batch", "recorded", "rerun", "calls"}``,
    or None when the bundle holds no recorded statistics of the event step to compare with
    (an evaluation forward is not in the ring; a bundle without history)."""
    t, meta = step.tensors, step.meta
    ev = step.event
    if "ring/steps" not in t or ev.get("evaluation") or not run.calls:
        return None
    rows = [i for i, s in enumerate(t["ring/steps"].tolist()) if s == ev.get("step")]
    fields = meta.get("ring", {}).get("call_fields", [])
    if not rows or "min" not in fields or "max" not in fields:
        return None
    r = rows[-1]
    recorded_on = next((m["device"] for m in meta.get("modules", []) if m.get("device")), None)
    rel = SAME_DEVICE if recorded_on is None or torch.device(recorded_on) == step.device \
        else OTHER_DEVICE
    names = [m["name"] for m in meta.get("modules", [])]
    allowed = meta.get("allow_inf", [])
    stats = t["ring/calls"][r, :, [fields.index("min"), fields.index("max")]].tolist()
    mods = t["ring/call_module"][r].tolist()
    mbs = t["ring/call_micro_batch"][r].tolist()
    rerun: dict[tuple[str, int, int], tuple[float, float]] = {}
    for c in run.calls:
        pairs = [(float(a), float(b)) for a, b in c.minmax]
        if pairs:
            rerun[(c.module, c.micro_batch, c.call)] = (min(a for a, _ in pairs),
                                                        max(b for _, b in pairs))
    seen: dict[tuple[str, int], int] = {}
    compared = 0
    for (lo, hi), m, mb in zip(stats, mods, mbs):
        if m < 0 or m >= len(names):  # past a truncated row's end
            continue
        name = names[m]
        k = seen.get((name, mb), 0)
        seen[(name, mb)] = k + 1
        soft = any(fnmatch.fnmatchcase(name, p) for p in allowed)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            if soft and not (math.isnan(lo) or math.isnan(hi)):
                continue  # an intended -inf mask
            if math.isnan(lo) and math.isnan(hi) and not _had_float(rerun, name, mb, k):
                continue  # a call with no floating output
            break  # the first non-finite call: what follows depends on it
        got = rerun.get((name, mb, k))
        if got is None:
            return _differs(name, k, mb, [lo, hi], None, compared)
        if not (_close(lo, got[0], rel) and _close(hi, got[1], rel)):
            return _differs(name, k, mb, [lo, hi], list(got), compared)
        compared += 1
    extra = next((c for c in run.calls if c.module not in set(names)), None)
    if extra is not None:
        return _differs(extra.module, extra.call, extra.micro_batch, None,
                        list(rerun.get((extra.module, extra.micro_batch, extra.call), ())),
                        compared)
    return {"matches": True, "module": None, "call": None, "micro_batch": None,
            "recorded": None, "rerun": None, "calls": compared, "step": ev.get("step")}


def _had_float(rerun, name: str, mb: int, k: int) -> bool:
    return (name, mb, k) in rerun


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=ABS)


def _differs(module: str, call: int, mb: int, recorded, rerun, compared: int) -> dict[str, Any]:
    return {"matches": False, "module": module, "call": call, "micro_batch": mb,
            "recorded": None if recorded is None else {"min": recorded[0], "max": recorded[1]},
            "rerun": None if not rerun else {"min": rerun[0], "max": rerun[1]},
            "calls": compared}


def describe(fid: dict[str, Any]) -> str:
    """One sentence for the text report and the note."""
    name = "<root>" if fid["module"] == "" else fid["module"]
    rec, got = fid["recorded"], fid["rerun"]
    if rec is None:
        what = "ran in the re-run but is not in the recorded model"
    elif got is None:
        what = "did not run in the re-run although it ran in training"
    else:
        what = (f"gave [{rec['min']:.6g}, {rec['max']:.6g}] in training but "
                f"[{got['min']:.6g}, {got['max']:.6g}] in the re-run")
    return (f"'{name}' (call {fid['call']}, micro-batch {fid['micro_batch']}) {what}, after "
            f"{fid['calls']} call(s) that agree: the factory builds a different model than the "
            "one recorded (it cannot see run-time configuration: command-line flags, globals, "
            "config files); record with FlightRecorder(..., factory_kwargs={...}) or pass "
            "--factory-kwargs '{...}' so it builds the same one")
