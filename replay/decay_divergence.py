"""The optimizer's own weight decay as what drove the weights or its state non-finite.

A decay term multiplies the weights by a number whatever the gradients are: a decoupled decay
by ``1 - lr * wd`` per update (AdamW's ``p.mul_``, a fused or foreach kernel's, Lion's), which
is below -1 once ``lr * wd`` passes 2, and SGD's coupled ``wd * p`` through its momentum buffer
(``replay.coupled_decay``). Such an update grows the weights geometrically and, with them, the
gradients and an Adam's ``exp_avg_sq``: the event then reads as a large gradient or a bad update
(the hint said to find what made the gradients large, or to clip them, which does not reach
the decay). The factor is the window's re-run's where it saw the op (``replay.weight_scale``),
else the one a probe of the update rule measures: a fresh optimizer of the same class and
group values, given a parameter of spread values and gradients of 0, updated once with the
decay and once without; a decay's factor is one number for every entry, and 1 without it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from .ascent import ascent_hint
from .coupled_decay import coupled_decay, coupled_growth, coupled_text
from .negative_lr import negative_lr_hint
from .weight_scale import scale_text, scaled_update

_SPREAD = 64  # entries of the probe's parameter (values 0.5 to 1.5)
_TOL = 1e-3  # how far one entry's factor may be from the others' (float32 rounding)


def update_rule_hints(step, report: dict[str, Any]) -> None:
    """The hints the optimizer's hyper-parameters explain, after the growth's: ascent with
    ``maximize=True``, a learning rate below 0, a weight decay that grows the weights."""
    ascent_hint(step, report)
    negative_lr_hint(step, report)
    decay_hint(step, report)


def decay_growth(step, report: dict[str, Any]) -> dict[str, Any] | None:
    """The decay that grows the weights whatever the gradients are, or None:
    ``{"kind": "seen" | "coupled" | "probed", "lr", "weight_decay", "factor" or "growth", ...}``."""
    if (seen := scaled_update(report)) is not None:
        return {"kind": "seen", **seen}
    if (coupled := coupled_decay(step)) is not None:
        return {"kind": "coupled", **coupled}
    opt = step.optimizer
    for i, group in enumerate(getattr(opt, "param_groups", None) or ()):
        factor = _probed_factor(opt, group)
        if factor is not None:
            return {"kind": "probed", "group": i, "factor": factor,
                    "lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]),
                    "param": _first_name(step, group)}
    return None


def decay_tries(step, report: dict[str, Any]) -> list[str]:
    """``--try auto``'s changes for a decay that grows the weights: ``wd=0``, and where the
    decay still grows them at a tenth of the rate (auto's ``lr=0.1x``), the group's rate that
    brings lr * weight_decay to 0.1."""
    found = decay_growth(step, report)
    if found is None:
        return []
    lr, wd, group = _decay_group(step, found)
    if not (lr and wd) or not _grows_at(step, found, group, 0.1 * lr, wd):
        return ["wd=0"]
    key = f"lr[{group}]" if len(step.optimizer.param_groups) > 1 else "lr"
    return ["wd=0", f"{key}={0.1 / wd:.3g}"]


def _grows_at(step, found: dict[str, Any], group: int, lr: float, wd: float) -> bool:
    """Whether the decay found still grows the weights at rate ``lr``."""
    if found["kind"] == "coupled":
        g = {**step.optimizer.param_groups[group], "lr": lr}
        return (coupled_growth(g) or 0.0) > 1.0 + 1e-9
    return abs(1.0 - lr * wd) > 1.0  # (a decoupled factor 1 - lr * weight_decay)


def _decay_group(step, found: dict[str, Any]) -> tuple[float | None, float | None, int]:
    """(lr, weight_decay, group) of the decay found; a seen factor's from the group whose
    1 - lr * weight_decay it is."""
    if "lr" in found:
        return found["lr"], found["weight_decay"], found["group"]
    for i, g in enumerate(step.optimizer.param_groups):
        try:
            lr, wd = float(g.get("lr") or 0.0), float(g.get("weight_decay") or 0.0)
        except (TypeError, ValueError):
            continue
        if wd and math.isclose(1.0 - lr * wd, found["factor"], rel_tol=1e-3):
            return lr, wd, i
    return None, None, 0


def decay_hint(step, report: dict[str, Any]) -> None:
    """Name the decay in the hint (and ``report["weight_decay"]``) of an update's or an
    overflow's report, or of one whose window shows the run grew, that does not name it yet."""
    hint, cause = report.get("hint") or "", report.get("cause")
    w = report.get("window") or {}
    began = (w.get("precursors_began") or {}).get("step")
    grew = began is not None and began < (report.get("event") or {}).get("step", began)
    if step.optimizer is None or not (cause in ("optimizer", "overflow") or grew):
        return
    found = decay_growth(step, report)
    if found is None:
        return
    report["weight_decay"] = {k: v for k, v in found.items() if k != "source"}
    if "weight_decay" in hint or "weight decay" in hint:  # (the growth's hint said it)
        return
    text = decay_text(step, found, bool(w.get("reproduced")))
    report["hint"] = (f"{hint}. But the optimizer's own weight decay grows the weights by itself, "
                      f"and the gradients and state with them: {text}" if hint else text)


def decay_text(step, found: dict[str, Any], windowed: bool) -> str:
    """What the decay :func:`decay_growth` found does, and what to change."""
    return (scale_text(found, probed=False) if found["kind"] == "seen" else
            coupled_text(found, windowed) if found["kind"] == "coupled" else
            probed_text(step, found, windowed))


def probed_text(step, found: dict[str, Any], windowed: bool) -> str:
    """What a probed decay factor does (see :func:`decay_growth`)."""
    f, lr_wd = found["factor"], found["lr"] * found["weight_decay"]
    cls = type(step.optimizer).__name__
    group = f" (parameter group {found['group']})" if found["group"] else ""
    what = (f"the factor 1 - lr * weight_decay is below -1 once lr * weight_decay passes 2: it "
            f"flips the weights' sign and grows them {abs(f):.3g}x" if f < 0 else
            f"a negative weight decay grows the weights {f:.3g}x")
    tries = ("--try wd=0 tests it" if windowed else "record with FlightRecorder(..., rewind=N) "
             "so that --try wd=0 re-runs the steps that grew")
    return (f"{cls}'s weight_decay={found['weight_decay']:.3g}{group} at lr={found['lr']:.3g} "
            f"makes lr * weight_decay {lr_wd:.3g}, and its update (re-run on its own with "
            f"gradients of 0) multiplies {found['param'] or 'the weights'} by {f:.4g}: {what} "
            "per update, whatever the gradients were, so clipping them does not stop it; keep "
            "lr * weight_decay well below 1 at the schedule's peak: lower weight_decay or the "
            f"learning rate ({tries})")


def _probed_factor(opt, group: dict[str, Any]) -> float | None:
    """The one number a fresh update of ``group``'s values multiplies a parameter by with
    gradients of 0 when its weight decay is what moves it, if of magnitude above 1; None for
    no decay, a decay through a momentum buffer (``replay.coupled_decay`` reads those), an
    optimizer that cannot be built so, or an update that is no single factor."""
    try:
        wd, mom = float(group.get("weight_decay") or 0.0), float(group.get("momentum") or 0.0)
    except (TypeError, ValueError):
        return None
    if not wd or mom or not math.isfinite(wd) or not group.get("params"):
        return None
    like = group["params"][0]
    gen = torch.Generator().manual_seed(0)  # (its own generator: the run's RNG is untouched)
    start = (0.5 + torch.rand(_SPREAD, generator=gen, dtype=torch.float64)).to(
        device=like.device, dtype=like.dtype)
    with_decay, without = _ratio(opt, group, start, wd), _ratio(opt, group, start, 0.0)
    if with_decay is None or without is None or not torch.allclose(
            without, torch.ones_like(without), atol=_TOL):
        return None
    f = float(with_decay.mean())
    if not math.isfinite(f) or float((with_decay - f).abs().max()) > _TOL * max(1.0, abs(f)):
        return None
    return f if abs(f) > 1.0 + _TOL else None


def _ratio(opt, group: dict[str, Any], start: torch.Tensor, wd: float) -> torch.Tensor | None:
    """Per entry, what one update from a fresh state with gradients of 0 multiplied a copy of
    ``start`` by; None when the optimizer cannot be built or stepped that way."""
    values = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
    probe = torch.nn.Parameter(start.clone())
    probe.grad = torch.zeros_like(probe)
    try:  # (an update that draws noise draws it from a forked generator: the re-runs' own)
        with torch.random.fork_rng(devices=[]):
            fresh = type(opt)([{**values, "params": [probe], "weight_decay": wd}])
            fresh.step()
    except Exception:  # (a wrapper, a required argument, a closure it needs: no probe)
        return None
    return probe.detach().double() / start.double()


def _first_name(step, group: dict[str, Any]) -> str | None:
    model = getattr(step, "model", None)
    if model is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    return next((names[id(p)] for p in group["params"] if id(p) in names), None)
