"""An update's hyper-parameters that were themselves NaN or +-Inf (a learning-rate schedule
that divides by the step count at step 0, a sqrt of a negative one past its end), from what
recorded that update's values: the rewind window's record of the step, the ring buffer's
learning rates (taken as the step closed, before its update) and the bundle's groups."""

from __future__ import annotations

import math
from typing import Any

from .group_lr import new_lr
from .load import Step
from .optim import SPELT, number_pair, pair_eps

KEYS = ("lr", "weight_decay", "eps", "momentum", "betas", "alpha")


def non_finite_hyper(step: Step, at, own: list[dict]) -> tuple[str, str] | None:
    """``(name, value)`` of a hyper-parameter of the update at step ``at`` that was NaN or
    +-Inf, in the groups ``own`` (of the bundle's ``param_groups``), else None. A bundle written
    after that update holds the groups as the schedule left them for the next step: the update's
    own learning rate is the ring buffer's, recorded when its step closed (a float there even
    where the group holds a tensor); the others are the window's record of it, or the groups'."""
    groups = step.meta.get("optimizer", {}).get("param_groups", [])
    # lr=None (Hugging Face Adafactor's relative step) is a NaN in the ring, not a NaN rate
    ring = _ring_lrs(step, at, [i for i, g in enumerate(groups) if any(g is o for o in own)
                                and g.get("lr") is not None])
    records = (step.meta.get("rewind") or {}).get("records") or []
    hyper = next((r.get("hyper") for r in records if r.get("step") == at), None)
    if hyper and len(hyper) == len(groups):
        own = [h for h, g in zip(hyper, groups) if any(g is o for o in own)] or hyper
    if ring is not None and (bad := next((v for v in ring if not math.isfinite(v)), None)):
        return "lr", repr(bad)
    for g in own:
        for k in KEYS[ring is not None:]:
            for v in (g.get(k) if isinstance(g.get(k), list) else [g.get(k)]):
                v = _number(step, v)
                if v in SPELT or (isinstance(v, float) and not math.isfinite(v)):
                    return k, str(v)
    return None


def _number(step: Step, v):
    """``v``, or the number a one-element tensor entry holds (``{"$t": key}``: a learning rate
    a scheduler keeps as a tensor, as capturable and fused optimizers take it)."""
    t = step.tensors.get(v["$t"]) if isinstance(v, dict) and "$t" in v else None
    return float(t) if t is not None and t.numel() == 1 and t.is_floating_point() else v


def _ring_lrs(step: Step, at, idx: list[int]) -> list[float] | None:
    """The learning rates of groups ``idx`` in the ring buffer's row of step ``at``, None when
    it holds no such row (or the rates of other groups than the bundle's)."""
    steps, lrs = step.tensors.get("ring/steps"), step.tensors.get("ring/lr")
    if steps is None or lrs is None or not idx or at not in steps.tolist() \
            or max(idx) >= lrs.shape[1]:
        return None
    row = lrs[steps.tolist().index(at)].tolist()
    return [row[i] for i in idx]


def decode_non_finite_hyper(opt) -> None:
    """The bundle's JSON spells non-finite floats as 'nan', 'inf', '-inf' (``jsonable``); a
    NaN learning rate is exactly what this replay must re-run, so turn them back into floats
    where the optimizer's own default for that hyper-parameter is a number (SGD's and Adam's
    ``weight_decay=0`` and SGD's ``momentum=0`` are ints)."""
    for group in opt.param_groups:
        for k, v in group.items():
            default = opt.defaults.get(k)
            if isinstance(v, str) and v in SPELT and isinstance(default, (int, float)) \
                    and not isinstance(default, bool):
                group[k] = float(v)


def set_hyper(opt, record: dict[str, Any], sub: Step, change) -> None:
    """The record's hyper-parameters into ``opt``'s groups for a window re-run's update, as
    the change (``replay.window.Change``) sets them; ``wd`` leaves the groups with
    no weight decay beside decayed ones (norms and biases, by the usual recipe) at 0."""
    decayed = any(_decays(h) for h in record.get("hyper") or [])
    for i, (group, rec) in enumerate(zip(opt.param_groups, record.get("hyper") or [])):
        for k, v in rec.items():
            if k == "params" or (isinstance(v, dict) and "$repr" in v):
                continue
            if isinstance(v, dict) and "$t" in v:
                v = sub.tensors[v["$t"]].to(sub.device, copy=True)
            elif isinstance(v, str) and v in SPELT:
                v = float(v)
            group[k] = number_pair(v)
        if change.lr is not None or change.lr_factor is not None:
            group["lr"] = new_lr(group.get("lr"), i, change)
        if change.eps is not None:
            group["eps"] = pair_eps(group.get("eps"), change.eps)
        if change.weight_decay is not None and (_decays(rec) or not decayed):
            group["weight_decay"] = change.weight_decay
        for k, v in change.hyper:  # (a pair that bounds the update: replay.update_bound)
            group[k] = v


def _decays(hyper: dict[str, Any]) -> bool:
    v = hyper.get("weight_decay")
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v != 0
