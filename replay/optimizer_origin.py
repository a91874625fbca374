"""The origin of an ``optimizer`` event: the update re-run under the op finder (a guard
bundle's, from the copies taken before it), and the hint of an update the bundle cannot re-run
(its weights are those after it) whose learning rate or eps the bundle alone shows."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from recorder.finite import finite, tensors_kind
from recorder.inner_optim import put_state, state_items
from recorder.seq_state import cloned

from .eps_text import eps0_text
from .findings import AFTER_UPDATE, UPDATE_NOT_RERUN, finish, origin_fields
from .half_update import half_overflow_why
from .hyper import decode_non_finite_hyper, non_finite_hyper
from .load import Step
from .looked_up_rows import looked_up_rows
from .nan_moments import nan_moment_why
from .ops import OpFinder
from .optim import eps_lost_text, per_parameter, stale_state
from .quantised_state import zero_scale_why
from .reduced_grads import use_reduced_grads
from .rerun import Runner
from .unrecorded_update import UNRECORDED_NOT_RERUN, unrecorded_update_hint
from .update_bound import beyond_dtype_text, optimizer_advice
from .update_domain import (
    domain_why,
    negative_input,
    owner_type,
    rows_of_weights,
    update_domain,
    updated_rows,
)
from .zero_grad import zero_gradient_text
from .zero_input_columns import zero_input_columns_text
from .zero_rate import finite_at_a_rate, zero_rate_why


def report_optimizer(report, step: Step, runner: Runner) -> dict[str, Any]:
    decode_non_finite_hyper(step.optimizer)
    # (gradients with a graph, as the loop's backward(create_graph=True) made them: an update
    # differentiating them again, SophiaH's or AdaHessian's Hutchinson estimate, needs it)
    runner.create_graph = bool(step.meta.get("grads_graph"))
    with warnings.catch_warnings():  # (torch's note on create_graph's cycle is the loop's)
        warnings.filterwarnings("ignore", "Using backward.. with create_graph")
        runner.run(instrument=False)
    use_reduced_grads(step, step.model)  # (every rank's, as DDP's all-reduce gave the update)
    _own_copies(step.model, step.optimizer)
    stale = stale_state(step.model, step.optimizer)
    quantised = zero_scale_why(step.model, step.optimizer)  # (before the update rewrites it)
    rate = finite_at_a_rate(step.model, step.optimizer)  # (every lr 0: finite at one > 0?)
    finder = OpFinder()
    with per_parameter(step.optimizer), finder:  # (a fused kernel shows no op)
        step.optimizer.step()
    params = dict(step.model.named_parameters())
    bad = [n for n, p in params.items() if not finite(p)]
    hit = finder.origin()
    made = hit.made if hit else tensors_kind(params[n] for n in bad)
    origin = origin_fields(phase="optimizer", params=bad, param=(bad or [None])[0],
                           op=hit.op if hit else None, source=hit.source if hit else None,
                           chain=finder.chain(), made=made)
    domain = update_domain(hit)
    origin["domain"] = domain
    if zero_rate_why(domain, rate):  # (the rate --try auto proposes)
        origin["zero_rate"] = rate
    # (the batch is the update's own here: the ids an embedding took, its rows looked up)
    rows, where = updated_rows(bad[0], params[bad[0]], owner_type(step.meta, bad[0]),
                               step.model, looked_up_rows(step, bad[0])) if bad else ({}, "")
    where += zero_input_columns_text(step, bad[0], params[bad[0]]) if bad else ""
    origin.update(rows)  # (an embedding's entities: which the update broke)
    hint = optimizer_hint(step, hit.op if hit else None, made, bad, step.event.get("step"),
                          "re-run from the copies taken before the update",
                          stale=stale, domain=domain, stale_why=quantised,
                          rate=rate) + where if bad else None
    return finish(report, origin, "optimizer", reproduced=bool(bad), hint=hint)


def optimizer_hint(step: Step, op: str | None, made: str | None, params: list[str], at,
                   rerun_from: str, stale: tuple[str, str, str] | None = None,
                   domain: str | None = None, stale_why: str | None = None,
                   rate: float | None = None) -> str:
    """The hint of an update re-run under the op finder that made ``made`` in ``params``: a
    guard bundle's (:func:`report_optimizer`) or a rewind window's
    (``replay.window_report``). An Adam-style update with ``eps=0`` in the bundle's
    hyper-parameters that made NaN is the 0/0 of gradients that have all been exactly 0; one
    whose eps is 0 in the weights' dtype (1e-8 in float16) divides by 0 where v rounded to 0.
    ``domain``: the update's op left its domain (``replay.update_domain``); ``stale_why``: what
    made the stale state non-finite, when known (``replay.quantised_state``); ``rate``: where
    every lr was 0, a positive one the update is finite at (``replay.zero_rate``)."""
    opt = step.meta.get("optimizer") or {}
    cls = opt.get("class", "the optimizer").rpartition(".")[2]
    groups = opt.get("param_groups", [])
    # (the groups holding the weights it made non-finite; every group when none is known)
    own = [g for g in groups if set(g.get("params") or ()) & set(params)] or groups
    bad = non_finite_hyper(step, at, own)
    big = None if bad else beyond_dtype_text(step, own, params)  # (ASGD's lr=1e39)
    why = (_hyper_why(bad, step) if bad else big if big else stale_why if stale_why else
           f"its state {stale[1]} of {stale[0]} already held {stale[2]} before this update "
           "(the recorder does not read optimizer state each step): loaded that way "
           "(optimizer.load_state_dict from a bad checkpoint) or written outside the "
           "optimizer; resume from a checkpoint whose optimizer state is finite, or reset that "
           "parameter's state"
           if stale else
           # a negative input (a rounded eigenvalue under Shampoo's -1/4 power) is no eps's
           (None if negative_input(domain)
            else _eps_why(step, own, params, made))
           or zero_rate_why(domain, rate)
           or (domain and domain_why(domain) + zero_gradient_text(step, params, at))
           or half_overflow_why(step, made, params) or optimizer_advice(step, own))
    return (f"{op + ' in ' if op else ''}{cls}'s update at step {at} made {made} in "
            f"{params[0]} from finite gradients and weights ({rerun_from}); {why}")


def mark_update_not_rerun(report: dict[str, Any], step: Step) -> None:
    """Say an update the bundle holds the weights after was not re-run: the report's first
    line ("not re-run", not "NOT reproduced", which reads as nondeterminism) and its note (an
    update no recorded step held kept nothing a copy could be taken of,
    replay.unrecorded_update)."""
    report["not_rerun"] = AFTER_UPDATE
    report["problems"].append(UNRECORDED_NOT_RERUN if step.event.get("no_step_closed")
                              else UPDATE_NOT_RERUN)


def after_update_hint(step: Step, params: list[str]) -> str | None:
    """The hint of an update the bundle cannot re-run (it holds the weights after it) whose
    learning rate was non-finite (the ring buffer's record of its step) or whose eps was 0 (or
    is 0 in the weights' dtype), which the bundle alone shows; else None."""
    if unrecorded := unrecorded_update_hint(step, params):  # (no step held that update)
        return unrecorded
    opt = step.meta.get("optimizer") or {}
    groups = [g for g in opt.get("param_groups", []) if set(g.get("params") or ()) & set(params)]
    bad = non_finite_hyper(step, step.event.get("step"), groups)
    why = _hyper_why(bad, step) if bad else beyond_dtype_text(step, groups, params) \
        or _eps_why(step, groups, params, None)
    if not why:  # (a moment that came in NaN: the rows are the state's, none said)
        why = nan_moment_why(step, params)
    elif not bad and (w := step.tensors.get(f"weights/{params[0]}")) is not None:
        # (the rows it broke, from the bundle's weights after it: an embedding's entities
        # absent from the batch, told by the second moment the update left, 0 where every
        # gradient was; the bundle's gradients may be a later backward's, through the NaN)
        why += rows_of_weights(params[0], w, _second_moment(step, params[0]),
                               step.tensors.get(f"optim/{params[0]}/exp_avg"),
                               owner_type(step.meta, params[0]), step.model)[1]
        why += zero_input_columns_text(step, params[0], w)
    return why and (f"{opt.get('class', '').rpartition('.')[2]}'s update at step "
                    f"{step.event.get('step')} made {params[0]} non-finite (not re-run: the "
                    f"bundle holds the weights after it); {why}")


def _second_moment(step: Step, name: str) -> torch.Tensor | None:
    """The square-gradient average the update left for parameter ``name`` (Adam's
    ``exp_avg_sq``, RMSprop's ``square_avg``, Adagrad's ``sum``), shaped as it; else None."""
    w = step.tensors.get(f"weights/{name}")
    for key in ("exp_avg_sq", "square_avg", "sum"):
        v = step.tensors.get(f"optim/{name}/{key}")
        if v is not None and w is not None and v.shape == w.shape:
            return v
    return None


def _hyper_why(bad: tuple[str, str], step: Step) -> str:
    if bad[0] == "lr" and (anchors := _lr_anchors(step)):
        cls = ((step.meta.get("lr_scheduler") or {}).get("class") or "").rpartition(".")[2]
        return (f"its lr was {bad[1]} in that update, and the param group's {anchors} too, "
                f"the settings {cls or 'the schedule'} derives every lr from: they were "
                "non-finite as given (a max_lr or base lr of NaN: an LR finder's suggestion "
                "from losses that went NaN, a ratio of settings over 0), no step's formula "
                "made them so; fix them where the schedule is built")
    return (f"its {bad[0]} was {bad[1]} in that update: {_writer(bad[0], step)} "
            "computed it (a division by a step count of 0, a 0/0, a sqrt or log of a negative "
            "step count); fix that value")


def _lr_anchors(step: Step) -> str:
    """The learning-rate settings other than ``lr`` a scheduler keeps in the optimizer's param
    groups (OneCycleLR's ``max_lr``, ``initial_lr``, ``min_lr``; SWALR's ``swa_lr``) that are
    non-finite, as ``name=value`` text; "" when none is."""
    found = {}
    for g in (step.meta.get("optimizer") or {}).get("param_groups") or []:
        for k, v in g.items():
            if k != "lr" and k.endswith("lr") and k not in found and _non_finite(v):
                found[k] = str(v)
    return ", ".join(f"{k}={v}" for k, v in found.items())


def _non_finite(v) -> bool:
    """Whether a param group's value (a number, or as the bundle writes one: 'nan') is."""
    try:
        return not math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _writer(name: str, step: Step) -> str:
    """Who wrote a non-finite learning rate: the scheduler the recorder was given, named with
    the step it had reached (its ``last_epoch``), else a schedule or the loop."""
    sched = step.meta.get("lr_scheduler") or {}
    if name != "lr" or not sched.get("class"):
        return "a schedule or the loop"
    state = dict((sched.get("state") or {}).get("$dict") or [])
    at, cls = state.get("last_epoch"), sched["class"].rpartition(".")[2]
    formula = "its lr_lambda" if "lr_lambdas" in state else "its formula"
    return (f"the lr_scheduler given to the recorder ({cls}"
            + (f", at last_epoch {at} when the event was caught" if isinstance(at, int)
               else "") + f"; evaluate {formula} at each step up to there) or the loop")


def _eps_why(step: Step, own: list[dict], params: list[str], made: str | None) -> str | None:
    """An eps that left the update's division by sqrt(v) + eps a division by 0: eps=0 where
    the update made NaN, or the weights it left hold NaN (RAdam's 1 / (sqrt(v) + eps) made
    +inf, which its m = 0 then made NaN), or an eps that the weights' dtype rounds to 0
    (Adafactor's eps1 squared)."""
    if "nan" in (made, step.event.get("kind")) and any(g.get("eps") == 0 for g in own):
        return eps0_text((step.meta.get("optimizer") or {}).get("class", ""), own)
    return eps_lost_text(step, own, params)


def _own_copies(model, opt) -> None:
    """Give the weights and the optimizer state copies of their own before an update writes
    them in place: the rebuilt model shares the bundle's tensors (``replay.load``), which must
    stay the state before the update for the what-ifs re-run after this one."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    for p, st in state_items(opt):
        put_state(opt, p, {k: cloned(v) for k, v in st.items()})
