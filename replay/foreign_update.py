"""Weights of the event's module that an optimizer the recorder was not given updated.

A loop with two optimizers (a fine-tune's head stepped by its own ``head_opt`` beside the
recorded backbone's; a GAN's second network) gives the recorder one. The ring keeps the norms
of the trained parameters the recorded optimizer does not hold, as each step closed
(``recorder.grads.unowned_weight_norms``), and the bundle their weights: when the event's op is
in a module whose such weights moved, that other optimizer's update grew them, and lowering
the recorded optimizer's rate (the growth hint's remedy, ``--try lr=0.1x``) changes nothing of
theirs. Read from the bundle alone (its optimizer's groups, ``frozen``, the ring).
"""

from __future__ import annotations

import math

# relative change of a norm below which the weights did not move (float32's rounding of it)
MOVED = 1e-5


def unheld_trained(step) -> list[str]:
    """The model's trained parameters the recorded optimizer's groups do not hold."""
    if (named := step.meta.get("unheld_trained")) is not None:  # (the recorder's own list)
        return list(named)
    groups = (step.meta.get("optimizer") or {}).get("param_groups") or []  # (older bundles)
    held = {n for g in groups for n in g.get("params") or ()}
    frozen = set(step.meta.get("frozen") or ())
    return [n for n in step.meta.get("params") or [] if n not in held and n not in frozen] \
        if groups else []


def _norms(step, name: str) -> tuple[list[tuple[int, float]], float | None]:
    """The ring's norms of ``name`` by step, and its weights' norm in the bundle (float64)."""
    names = step.meta.get("params") or []
    ring, steps = step.tensors.get("ring/param_norms"), step.tensors.get("ring/steps")
    rows = []
    if ring is not None and steps is not None and name in names:
        col = ring[:, names.index(name)].tolist()
        rows = [(int(s), v) for s, v in zip(steps.tolist(), col) if not math.isnan(v)]
    w = step.tensors.get(f"weights/{name}")
    now = float(w.detach().double().norm()) if w is not None and w.is_floating_point() else None
    return rows, now


def _moved(rows: list[tuple[int, float]], now: float | None) -> bool:
    vals = [v for _, v in rows] + ([now] if now is not None else [])
    if not vals or not math.isfinite(vals[0]):
        return False
    return any(not math.isfinite(v) or abs(v - vals[0]) > MOVED * max(abs(vals[0]), 1e-30)
               for v in vals[1:])


def foreign_weights(step, report) -> dict | None:
    """``{"module", "params", "first", "now", "held"}`` when the event's module holds trained
    weights the recorded optimizer does not, and they moved over the ring (another optimizer's
    updates); else None."""
    o = report.get("origin") or {}
    module = o.get("module")
    if not module or step.optimizer is None and not step.meta.get("optimizer"):
        return None
    mine = [n for n in unheld_trained(step) if n.startswith(f"{module}.")]
    found = [(n, *_norms(step, n)) for n in mine]
    moved = [(n, rows, now) for n, rows, now in found if _moved(rows, now)]
    if not moved:
        return None
    name, rows, now = moved[0]
    groups = (step.meta.get("optimizer") or {}).get("param_groups") or []
    held = [n for g in groups for n in g.get("params") or ()]
    return {"module": module, "params": [n for n, _, _ in moved], "first": rows[0],
            "now": now, "held": held,
            "cls": (step.meta.get("optimizer") or {}).get("class", "").rpartition(".")[2]}


def _names(names: list[str], most: int = 3) -> str:
    more = f" (+{len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def foreign_advice(step, report) -> str | None:
    """The growth hint's remedy when :func:`foreign_weights` finds the event's weights updated
    by an optimizer the recorder was not given; None otherwise."""
    f = foreign_weights(step, report)
    if f is None:
        return None
    s0, v0 = f["first"]
    now = "non-finite" if f["now"] is None or not math.isfinite(f["now"]) else f"{f['now']:.4g}"
    return (f"the weights of {f['module']} ({_names(f['params'])}) were updated by an optimizer "
            f"the recorder was not given (the recorded {f['cls'] or 'optimizer'} holds "
            f"{_names(f['held'])} only): their norm went from {v0:.4g} at step {s0} to {now} "
            f"in the bundle, so that optimizer's learning rate or gradients grew them, and "
            f"lowering the recorded one's (--try lr=0.1x) changes nothing of theirs; check that "
            f"optimizer's learning rate, and record it: put its parameters in the recorded "
            f"optimizer as a parameter group of their own (torch.optim.Adam([{{'params': "
            f"body}}, {{'params': head, 'lr': ...}}]): --try lr[1]=0.1x then tests its rate), "
            f"or, for a network of its own (a GAN's other one), record that network with its "
            f"optimizer")


def try_note(step, report) -> str | None:
    """Why an update-only try (lr, eps, wd, clip) cannot test a fix of such weights."""
    f = foreign_weights(step, report)
    if f is None:
        return None
    return (f"it changes the recorded optimizer's updates only, and {f['module']}'s "
            f"weights ({_names(f['params'])}) were updated by an optimizer the recorder was "
            f"not given, which no try re-runs (see the hint)")
