"""The recorded optimizer, rebuilt over the replay's model from the bundle (``replay.load``)."""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch
from torch import nn

from recorder.finite import finite, tensors_kind
from recorder.inner_optim import put_state, state_items
from recorder.seq_state import load_seq

from .eps_text import EPS0_CUSTOM_UPDATE, EPS_LOST_UPDATE, SQUARED_EPS_LOST
from .optim_attrs import attrs_note, restore_attrs
from .optim_class import installed_optimizer
from .sharded_optim import builtin_inner, unprefixed


def build_optimizer(step, model: nn.Module, opt_factory):
    """The recorded optimizer over ``model``'s parameters: its class (a ``torch.optim``
    built-in, else ``opt_factory(param_groups)`` from the factory), its groups'
    hyper-parameters and its per-parameter state, from the bundle; None (and a note on
    ``step``) when it cannot be rebuilt."""
    info = step.meta.get("optimizer")
    if not info:
        return None
    params = dict(model.named_parameters())
    cls = inner = None
    path = info["class"]
    if opt_factory is None:
        if path.startswith("torch.optim."):
            cls = getattr(torch.optim, path.rpartition(".")[2], None)
        elif (found := builtin_inner(info)) is not None:  # (ZeRO's local Adam)
            inner, cls = found
        else:  # (an optimizer library's class: pytorch_optimizer's Lion)
            cls = installed_optimizer(path)
        if cls is None:
            step.problems.append(f"the optimizer {path} is neither a torch.optim built-in nor a "
                                 "class of an installed package; return {'model': ..., "
                                 "'optimizer': lambda params: ...} from the factory")
            return None
    groups = []
    for g in info["param_groups"]:
        group = {"params": [params[n] for n in g["params"] if n in params]}
        for k, v in g.items():
            if k == "params" or (isinstance(v, dict) and "$repr" in v):
                continue
            if isinstance(v, dict) and "$t" in v:
                v = step.tensors[v["$t"]].to(step.device)
            group[k] = number_pair(v)
        groups.append(group)
    try:
        opt = opt_factory(groups) if opt_factory is not None else cls(groups)
    except Exception as e:
        way = "" if opt_factory is not None or path.startswith("torch.optim.") else (
            "; return {'model': ..., 'optimizer': lambda params: ...} from the factory")
        step.problems.append(f"the optimizer {path} could not be rebuilt ({type(e).__name__}: "
                             f"{e}){way}")
        return None
    if inner is None and (changed := restore_attrs(opt, info.get("attrs"))):
        step.problems.append(attrs_note(changed))
    scalars = info.get("state_scalars", {})
    for name, p in params.items():
        state = {}
        prefix = f"optim/{name}/"
        for key, t in step.tensors.items():
            if key.startswith(prefix):
                state[key[len(prefix):]] = t.to(step.device) if t.dim() else t
        state.update({k: load_seq(v, step.tensors, step.device)
                      for k, v in scalars.get(name, {}).items()})
        if inner is not None:  # (the wrapper's keys for its inner optimizer, as its own)
            state = unprefixed(state, inner)
        if state:
            put_state(opt, p, state)
    return opt


SPELT = ("nan", "inf", "-inf")  # the bundle's JSON spelling of non-finite floats (``jsonable``)


def number_pair(v):
    """A group's value as the optimizer took it: a JSON list of numbers (a tuple written by
    ``jsonable``: Adam's ``betas``, Rprop's ``etas`` and ``step_sizes``) as a tuple, its
    non-finite entries spelt 'nan'/'inf'/'-inf' as floats (Rprop's ``step_sizes=(1e-6,
    inf)``, whose 'inf' the update's ``clamp_`` refused); anything else as it is."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) or x in SPELT

    if not isinstance(v, list) or not v or not all(number(x) for x in v):
        return v
    return tuple(float(x) if isinstance(x, str) else x for x in v)


def needs_closure(opt) -> bool:
    """``opt.step()`` cannot run without a closure (``torch.optim.LBFGS``: it evaluates the
    whole forward and backward several times per update), which a re-run cannot give it."""
    try:
        p = inspect.signature(type(opt).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is inspect.Parameter.empty


@contextmanager
def per_parameter(opt):
    """``opt`` with its per-parameter implementation (``foreach=False``, not fused) while the
    block runs, so that the op finder sees which op made a value: fused and foreach kernels
    make every parameter's values in one op (a fused kernel in none it can name)."""
    saved = [(g.get("foreach"), g.get("fused")) for g in opt.param_groups]
    for g in opt.param_groups:
        if "foreach" in g:
            g["foreach"] = False
        if "fused" in g:
            g["fused"] = None
    try:
        yield opt
    finally:
        for g, (fe, fu) in zip(opt.param_groups, saved):
            if "foreach" in g:
                g["foreach"] = fe
            if "fused" in g:
                g["fused"] = fu


def eps_lost(step, groups: list[dict], params: list[str]) -> tuple[float, str] | None:
    """``(eps, dtype)`` when a group's ``eps > 0`` holding one of ``params`` rounds to 0 in the
    dtype of its recorded weights, in which the optimizer keeps its state and adds eps (Adam's
    default 1e-8 is under half float16's smallest subnormal): its m / (sqrt(v) + eps) then
    divides by 0 wherever v is 0, as with eps=0. None otherwise."""
    for g in groups:
        eps = g.get("eps")
        if not isinstance(eps, float) or not eps > 0:
            continue
        for name in g.get("params") or ():
            w = step.tensors.get(f"weights/{name}")
            if (name in params or not params) and w is not None and w.is_floating_point() \
                    and float(torch.tensor(eps, dtype=w.dtype)) == 0:
                return eps, str(w.dtype).removeprefix("torch.")
    return None


def safe_eps(dtype: str | None) -> str:
    """The eps an update in ``dtype`` keeps, as ``--try eps=`` spells it: the default ``1e-8``
    where it is not 0 in it, else the power of ten at or above the dtype's smallest normal
    value (``1e-4`` in float16)."""
    dt = getattr(torch, dtype or "float32", torch.float32)
    if float(torch.tensor(1e-8, dtype=dt)) != 0:
        return "1e-8"
    return f"1e{math.ceil(math.log10(torch.finfo(dt).tiny))}"


def pair_eps(value, change: float):
    """A group's eps after ``--try eps=``: a pair (``torch.optim.Adafactor``'s ``(eps1,
    eps2)``) keeps its eps2 and takes the value as eps1, the one that floors the update's
    denominator (a plain float for it raised in the optimizer: it unpacks two)."""
    return (change, *value[1:]) if isinstance(value, (list, tuple)) else change


def squared_eps_lost(step, groups: list[dict], params: list[str]) -> tuple[float, str] | None:
    """``(eps1, dtype)`` when a group holding one of ``params`` has an eps pair (Adafactor's)
    whose eps1 squared, the floor ``var.clamp_(min=eps1 * eps1)`` under its rsqrt, is 0 in
    the dtype of the recorded weights (an eps1 of 0, or Hugging Face's 1e-30, which adds eps1
    to g**2 instead: 1e-60 is 0 in float32). None eps1 is torch's default, the dtype's
    machine eps."""
    for g in groups:
        eps = g.get("eps")
        if not isinstance(eps, (list, tuple)) or len(eps) != 2:
            continue
        for name in g.get("params") or ():
            w = step.tensors.get(f"weights/{name}")
            if (name in params or not params) and w is not None and w.is_floating_point():
                e1 = torch.finfo(w.dtype).eps if eps[0] is None else eps[0]
                if isinstance(e1, (int, float)) and float(torch.tensor(e1 * e1,
                                                                       dtype=w.dtype)) == 0:
                    return float(e1), str(w.dtype).removeprefix("torch.")
    return None


def default_eps1(dtype: str | None) -> str:
    """torch's default eps1 of Adafactor in ``dtype`` (its machine eps), as ``--try eps=``
    spells it."""
    return f"{torch.finfo(getattr(torch, dtype or 'float32', torch.float32)).eps:.2g}"


def eps_lost_text(step, groups: list[dict], params: list[str]) -> str | None:
    """Why an update divided by 0 though its eps is not 0: the weights' dtype rounds it to 0
    (:func:`eps_lost`), or rounds Adafactor's eps1 squared to 0 (:func:`squared_eps_lost`)."""
    if lost := eps_lost(step, groups, params):
        return EPS_LOST_UPDATE.format(eps=lost[0], dtype=lost[1], safe=safe_eps(lost[1]))
    if lost := squared_eps_lost(step, groups, params):
        # only torch's Adafactor squares eps1; a hand-written one (Hugging Face's) adds it
        if ((step.meta.get("optimizer") or {}).get("class") or "").startswith("torch.optim."):
            return SQUARED_EPS_LOST.format(eps=lost[0], dtype=lost[1],
                                           safe=default_eps1(lost[1]))
        return EPS0_CUSTOM_UPDATE if lost[0] == 0 else None
    return None


def stale_state(model, opt) -> tuple[str, str, str] | None:
    """(parameter, state key, kind) of the first non-finite tensor in the optimizer's state
    (Adam's moments, a momentum buffer), or None."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in state_items(opt):
        for k, v in st.items():
            # (a tuple or list of tensors: a quantised state's codes and scales)
            for i, t in enumerate(v if isinstance(v, (tuple, list)) else [v]):
                if torch.is_tensor(t) and t.is_floating_point() and not finite(t):
                    at = f"{k}[{i}]" if isinstance(v, (tuple, list)) else k
                    return names.get(id(p), "?"), at, tensors_kind([t])
    return None


def state_note(at, model, opt) -> str | None:
    """The note of a window re-run whose update at step ``at`` left the optimizer's state
    non-finite and the weights finite (Adam's exp_avg_sq of a gradient whose square passed
    float32's range): training checks only the weights, so it trained on, and so does the
    re-run. None while the state is finite."""
    if (bad := stale_state(model, opt)) is None:
        return None
    return (f"re-running the window, {type(opt).__name__}'s {bad[1]} of {bad[0]} became "
            f"{bad[2]} in the update at step {at} while the weights stayed finite: the "
            "recorder checks the weights an update writes, not the optimizer's state, so "
            "training went on (and so does the re-run); the updates read that state from "
            "then on")
