"""Updates that multiply the weights by a factor of magnitude 1 or more.

A decoupled weight decay is ``p.mul_(1 - lr * wd)`` (or ``p.add_(p, alpha=-lr * wd)``): with
``lr * wd`` above 2 the factor is below -1, and every update flips the weights' sign and grows
them, whatever the gradients were (lion-pytorch's ``decoupled_weight_decay=True`` divides the
decay by the constructor's learning rate, so a schedule that raises the rate past it does it; a
negative decay does too). Clipping the gradients cannot stop that, so the window's re-run watches
each update for such a factor and the growth hint names it, with the line that applied it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from recorder.capture import map_tensors
from recorder.inner_optim import clear_state, put_state, state_items

from .cause_text import DO
from .compat import FOREACH_MUL_, TorchDispatchMode
from .coupled_decay import coupled_decay, coupled_text
from .grad_spike import grad_spike_advice
from .grown_state import grown_state_advice
from .line_search import no_line_search_advice
from .no_warmup import no_warmup_advice
from .noised_grads import noised_grads_advice
from .precursors import history
from .rising_lr import rising_lr_text, warming_lr_text
from .source import user_source
from .unmeasured_weights import OWN_UPDATE_ADVICE, own_update
from .unscaled_update import unscaled_update_advice
from .update_bound import bound_advice

aten = torch.ops.aten
_MUL = {aten.mul_.Tensor, aten.mul_.Scalar, FOREACH_MUL_}
_ADD = {aten.add_.Tensor}


def _number(x) -> float | None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, torch.Tensor) and x.ndim == 0 and not x.is_complex():
        return float(x.detach().item())
    return None


class WeightScales(TorchDispatchMode):
    """Watches ``optimizer.step()`` for an in-place product of a parameter with one number of
    magnitude >= 1 (other than 1): ``found`` then holds the first, as
    ``{"param", "factor", "source"}``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self._names = {_ptr(p): n for n, p in model.named_parameters()}
        self.found: dict[str, Any] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and (func in _MUL or func in _ADD):
            try:
                self._look(func, args, kwargs)
            except Exception:  # (a watcher never fails the re-run: a subclass, a shard)
                pass
        return func(*args, **kwargs)

    def _look(self, func, args, kwargs) -> None:
        targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        if func in _MUL:
            factor = _number(args[1]) if len(args) > 1 else None
        else:  # p.add_(p, alpha=a) is p * (1 + a) (Prodigy's and D-Adaptation's decay)
            same = len(args) > 1 and _ptr(args[1]) is not None and \
                _ptr(args[1]) == _ptr(args[0]) and args[1].shape == args[0].shape
            factor = 1.0 + float(kwargs.get("alpha", 1.0)) if same else None
        if factor is None or abs(factor) < 1.0 or factor == 1.0:
            return
        for t in targets:
            name = self._names.get(_ptr(t))
            if name is not None:
                self.found = {"param": name, "factor": factor, "source": user_source()}
                return


def _ptr(t) -> int | None:
    """Where a dense tensor's storage starts (None for anything else: a sparse gradient)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    return t.untyped_storage().data_ptr()


def scaled_update(report: dict[str, Any]) -> dict[str, Any] | None:
    """The first weight-multiplying update the report's window re-run saw, or None."""
    steps = (report.get("window") or {}).get("per_step") or []
    return next((s["weight_scale"] for s in steps if s.get("weight_scale")), None)


def probed_scale(step) -> dict[str, Any] | None:
    """Without a window, one update from the bundle's weights, state and hyper-parameters
    with every gradient 0, watched as above and then undone (weights, gradients, state and
    the groups' values as they were): a decay factor does not depend on the gradients."""
    model, opt = step.model, step.optimizer
    if model is None or opt is None:
        return None
    params = list(model.parameters())
    weights, grads = [p.detach().clone() for p in params], [p.grad for p in params]
    state = [(p, map_tensors(dict(st), lambda t: t.clone())) for p, st in state_items(opt)]
    groups = [{k: copy.copy(v) for k, v in g.items() if k != "params"}
              for g in opt.param_groups]
    watch = WeightScales(model)
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        with watch:
            opt.step()
    except Exception:  # (the probe's own failure: no finding)
        return None
    finally:
        with torch.no_grad():
            for p, w, g in zip(params, weights, grads):
                p.copy_(w)
                p.grad = g
        clear_state(opt)
        for p, st in state:
            put_state(opt, p, st)
        for g, saved in zip(opt.param_groups, groups):
            g.update(saved)
    return watch.found


def diverging_advice(step, windowed: bool) -> str:
    """The growth hint's remedy: a weight-multiplying update's (probed without a window), a
    buffer's the model carries across steps that grew (``replay.grown_state``), else the
    learning rate's and clipping's; a schedule still raising the rate at the event
    (``replay.rising_lr``) named first; an optimizer whose own warmup is off at an early event
    (``replay.no_warmup``: schedule-free's ``warmup_steps=0``) before the rate's; before them,
    an update that took the GradScaler's scaled gradients (``opt.step()`` without
    ``scaler.step``), or gradients the loop added to after backward (``replay.noised_grads``:
    DP-SGD's noise)."""
    if unscaled := unscaled_update_advice(step) or noised_grads_advice(step):
        return unscaled
    rising = rising_lr_text(history(step.meta, step.tensors))
    lead = f"{rising}; with it, " if rising else ""
    found = None if windowed else probed_scale(step)
    if found:
        return lead + scale_text(found, probed=True)
    if coupled := coupled_decay(step):
        return lead + coupled_text(coupled, windowed)
    if rising:
        return rising
    # (an update of the gradient's sign: its own bounds, not the rate's or clipping's)
    plain = bound_advice(step, windowed) or (
        DO["diverging_window"] if windowed else OWN_UPDATE_ADVICE if own_update(step.meta)
        else DO["diverging"])
    warming = warming_lr_text(history(step.meta, step.tensors))
    # (one batch's update out of a calm run: clipping, not the rate; see replay.grad_spike)
    return grown_state_advice(step) or no_line_search_advice(step) \
        or no_warmup_advice(step) or grad_spike_advice(step, windowed) \
        or (f"{plain}; {warming}" if warming else plain)


def scale_text(found: dict[str, Any], probed: bool = False) -> str:
    """What a weight-multiplying update does, for the growth hint (``probed``: seen in one
    update re-run from the bundle, not in the window's)."""
    f = found["factor"]
    at = f" ({found['source']})" if found.get("source") else ""
    what = (f"a decoupled weight decay's factor 1 - lr * weight_decay with lr * weight_decay "
            f"at {1 - f:.3g} (above 2, so the factor is below -1) flips the weights' sign and "
            f"grows them {abs(f):.3g}x per update" if f < 0 else
            f"a negative weight decay grows the weights {f:.3g}x per update")
    tries = ("record with FlightRecorder(..., rewind=N) so that --try wd=0 re-runs the steps "
             "that grew" if probed else "--try wd=0 tests it")
    lead = ("the update, re-run once from the bundle with gradients of 0, multiplies "
            if probed else "each update multiplied ")
    return (f"{lead}{found['param']} by {f:.4g}{at}: {what}, whatever the "
            "gradients were, so clipping them does not stop it; keep lr * weight_decay well "
            f"below 1 at the schedule's peak: lower weight_decay or the learning rate ({tries}; "
            "an optimizer that divides the decay by its initial learning rate, "
            "as lion-pytorch's decoupled_weight_decay=True does, gets there when a scheduler "
            "raises the rate above that initial one)")
