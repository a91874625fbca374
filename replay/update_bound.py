"""Which hyper-parameters bound an optimizer's update size, for the hints and ``--try auto``.

An update of the gradient's sign alone (torch's Rprop, Lion, SignSGD, Tiger: its magnitude
never reaches the weights) is not bounded by clipping; Rprop's (a param group with
``step_sizes`` and ``etas``) grows each element's step size by ``etas[1]`` per update while
the gradient keeps its sign, up to ``step_sizes[1]``: its ``lr`` is only the first step size.
A learning rate beyond the largest finite value of the weights' dtype (``ASGD(lr=1e39)`` under
float32) is an inf once cast to it. Defaults are read from the optimizer class's signature."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from .group_lr import jumped_group_text
from .load import Step

# classes (their names, any library's) whose update is lr times the sign of a gradient or of a
# momentum of it; Rprop is also told by its param groups' keys (GROWING)
SIGN_ONLY = frozenset({"Rprop", "Lion", "DAdaptLion", "SignSGD", "Signum", "Tiger"})
# the pair hyper-parameters that bound a growing step size: ``--try step_sizes=1e-6,50``
GROWING = ("step_sizes", "etas")


def _meta(step: Step) -> tuple[str, list[dict]]:
    opt = step.meta.get("optimizer") or {}
    return (opt.get("class") or "").rpartition(".")[2], opt.get("param_groups") or []


def grows_step(groups: list[dict]) -> bool:
    """Each group keeps a per-element step size that grows (Rprop's ``step_sizes``, ``etas``)."""
    return bool(groups) and all(all(k in g for k in GROWING) for g in groups)


def sign_only(step: Step) -> bool:
    """The update takes the gradient's sign alone: clipping the gradients changes nothing."""
    cls, groups = _meta(step)
    return cls in SIGN_ONLY or grows_step(groups)


def _pair(groups: list[dict], key: str) -> tuple[float, float] | None:
    """The largest ``(low, high)`` of a pair hyper-parameter over the groups ('inf' decoded)."""
    pairs = [tuple(float(x) for x in g[key]) for g in groups
             if isinstance(g.get(key), (list, tuple)) and len(g[key]) == 2]
    return max(pairs, key=lambda p: p[1]) if pairs else None


def class_default(step: Step, key: str) -> Any:
    """The optimizer class's own default for ``key`` (its ``__init__``'s), else None."""
    opt = step.optimizer
    try:
        p = inspect.signature(type(opt).__init__).parameters.get(key) if opt is not None else None
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def bound_advice(step: Step, windowed: bool, rerun: str = "the bundle's rewind window") \
        -> str | None:
    """The remedy of a growth for an update of the gradient's sign (else None): the knobs
    that bound its size, not the learning rate's or clipping's; ``windowed``: the tries
    re-run ``rerun``."""
    cls, groups = _meta(step)
    tries = bound_tries(step)
    if not tries:
        return None
    test, one = " and ".join(f"--try {t}" for t in tries), len(tries) == 1
    verb, each = ("re-runs", "it") if one else ("re-run", "each")
    test = (f"{test} {verb} {rerun} with {each}" if windowed else
            f"record with FlightRecorder(..., rewind=N) so that {test} {verb} the steps that grew")
    if not grows_step(groups):
        return (f"{cls} updates by lr times a sign, so the gradients' magnitude never reaches "
                "the weights and clipping them changes nothing: lower the learning rate "
                f"({test})")
    hi, eta = _pair(groups, "step_sizes")[1], _pair(groups, "etas")[1]
    dhi, deta = (class_default(step, k) or (None, None) for k in GROWING)
    return (f"{cls} grows each element's step size {eta:g}x per update while its gradient "
            f"keeps its sign, up to step_sizes[1]={hi:g}; its lr is only the first step size "
            "and it takes the gradient's sign alone, so neither a lower lr nor clipping bounds "
            "the update: lower the maximum step size step_sizes[1]"
            + (f" (default {dhi[1]:g})" if dhi else "")
            + " or the growth factor etas[1]"
            + (f" (default {deta[1]:g})" if deta else "") + f" ({test})")


def bound_tries(step: Step) -> list[str] | None:
    """``--try auto``'s proposals for an update of the gradient's sign (None for others):
    Rprop's maximum step size at its default (a tenth of it when already at or below it) and
    its growth factor at its default when above it; a tenth of the rate for the others."""
    cls, groups = _meta(step)
    if not grows_step(groups):
        return ["lr=0.1x"] if cls in SIGN_ONLY else None
    (lo, hi), (shrink, eta) = _pair(groups, "step_sizes"), _pair(groups, "etas")
    dhi, deta = (class_default(step, k) for k in GROWING)
    top = float(dhi[1]) if dhi and hi > dhi[1] else hi / 10
    out = [f"step_sizes={lo:g},{top:g}"]
    if deta and eta > deta[1]:
        out.append(f"etas={shrink:g},{deta[1]:g}")
    return out


def parse_pair(text: str, key: str, value: str) -> tuple[float, float]:
    """``--try step_sizes=1e-6,50``'s pair; ValueError (its one-line message) when not one."""
    try:
        pair = tuple(float(v) for v in value.split(","))
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(math.isfinite(v) and v >= 0 for v in pair):
        raise ValueError(f"--try {text!r}: {key} takes two finite numbers >= 0 separated by a "
                         f"comma (e.g. {key}={'1e-6,50' if key == 'step_sizes' else '0.5,1.2'})")
    return pair


def _dtype(step: Step, params: list[str]) -> torch.dtype | None:
    w = next((step.tensors.get(f"weights/{n}") for n in params), None)
    if w is None:
        w = next((t for k, t in step.tensors.items() if k.startswith("weights/")), None)
    return w.dtype if w is not None and w.is_floating_point() else None


def lr_beyond_dtype(step: Step, groups: list[dict], params: list[str] = ()) \
        -> tuple[float, torch.dtype] | None:
    """``(lr, dtype)`` of a finite learning rate above the largest finite value of the
    weights' dtype (an inf once cast to it), else None."""
    dtype = _dtype(step, list(params))
    for g in groups if dtype is not None else ():
        v = g.get("lr")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and abs(v) > torch.finfo(dtype).max:
            return float(v), dtype
    return None


def usable_lr(step: Step) -> float | None:
    """A rate to propose for one the weights' dtype cannot hold: the class's default."""
    v = class_default(step, "lr")
    return float(v) if isinstance(v, (int, float)) and 0 < v < math.inf else None


def beyond_dtype_text(step: Step, groups: list[dict], params: list[str]) -> str | None:
    """The hint of a learning rate the weights' dtype cannot hold, else None."""
    if (found := lr_beyond_dtype(step, groups, params)) is None:
        return None
    lr, dtype = found
    name, top = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
    use = usable_lr(step)
    return (f"its lr={lr:g} is beyond {name}'s largest finite value {top:.3g}, the dtype of "
            "the weights it updates, so the rate itself is not representable there: once cast "
            "to it (a rate kept in a tensor, or multiplied into a step in that dtype) it is inf, "
            "and so is every element's update (NaN where a gradient is 0), whatever the "
            "gradients; clipping does not change it: set a finite rate"
            + (f" (the default {use:g}; --try lr={use:g} tests it)" if use else ""))


def optimizer_advice(step: Step, groups: list[dict]) -> str:
    """The generic remedy of an optimizer event, in the knobs that optimizer has: eps only
    where its groups have one, the bounding knobs of an update of the gradient's sign."""
    rerun = "the bundle's rewind window" if step.meta.get("rewind") else "the update"
    if sign_only(step) and (bound := bound_advice(step, True, rerun)):
        return f"finite gradients became non-finite weights in optimizer.step(): {bound}"
    eps = ", eps," if any("eps" in g for g in groups) else ","
    return ("finite gradients became non-finite weights in optimizer.step(): check the "
            f"learning rate and schedule{eps} and clip gradients" + jumped_group_text(step))
