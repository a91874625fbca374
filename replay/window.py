"""Re-running a window of steps from a copy of the training state (``FlightRecorder(rewind=N)``).

>>> win = window_of(step)                           # doctest: +SKIP
>>> result = run_window(step, win)                  # forward, loss, backward, update, per step
>>> result.first.step, result.first.phase, result.first.params
(0, 'update', ['emb.weight'])

Each step of the window is re-run as training ran it: its recorded micro-batches and RNG states,
forward and loss under the recorded autocast, backward (from the recorded output gradients when
finite, or when no loss re-runs, else from the loss scaled by the recorded GradScaler scale), the
gradients unscaled and a step with a non-finite gradient skipped as the GradScaler skips it, then
``optimizer.step()`` with the hyper-parameters the recorded update used (so a scheduler's learning
rates are the recorded ones, whatever the scheduler). The first thing to go non-finite ends the
run: a forward output (by the bundle's infinity policy), the loss, a gradient, or the weights and
optimizer state after an update. A bad update is then re-run from its own starting state under the
op finder, with the optimizer's per-parameter (``foreach=False``, unfused) implementation, so the
op that made the value is named.

The same machinery runs a bundle without a window as a window of its one recorded step (the
``--try`` what-ifs of ``replay.whatif``); a :class:`Change` alters a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from recorder.finite import finite
from recorder.inner_optim import clear_state, put_state
from recorder.linalg import error_text, linalg_reason
from recorder.seq_state import load_seq

from .began import precursors_began  # noqa: F401  (the window report's, re-exported)
from .clip import loop_clip, ring_loss, total_norm
from .departure import param_norms
from .drop import drop_rows
from .group_lr import new_lr
from .hyper import set_hyper
from .load import Step
from .loop_grads import no_backward_reached_the_output
from .loopscale import unscale, window_factors, with_factors
from .loss_started import attributes_began
from .ops import OpFinder
from .optim import needs_closure, per_parameter, stale_state, state_note
from .outcome import Outcome, kinds_of, loss_value, run_outcome
from .outgrads import nonfinite_forwards
from .peers import average_gradients, peer_gradients
from .quantised_state import zero_scale_why
from .recorded import scale_of_the_step
from .rerun import Runner, restorable
from .sharded_optim import as_rebuilt
from .update_domain import update_domain
from .update_start import restore_start, saved_start
from .weight_scale import WeightScales
from .zero_rate import finite_at_a_rate


@dataclass
class Window:
    """Where a window's state and steps are: ``prefix`` of the copy's tensor keys (``rewind/``,
    or ``""`` for a bundle's own step), the copy's step and one record per step."""

    prefix: str
    copy_step: int
    records: list[dict[str, Any]]
    optimizer: dict[str, Any] | None  # state_scalars of the copy
    from_rewind: bool
    # the max_norm of the loop's own clip_grad_norm_, as the unchanged re-run found it
    loop_clip: float | None = None
    loop_unscale: bool = False  # the loop divides its gradients by its loss's factor (clip)
    loop_zeroes: bool = False  # the loop zeroed gradients whose norm overflowed (clip)
    # the loop's factor on each micro-batch's loss (accumulation's 1/k), by its index in the
    # step, as the unchanged re-run found them
    loss_factors: list[float] | None = None


@dataclass
class Change:
    """What a what-if changes in every step of a run (None: as recorded)."""

    lr: float | None = None
    lr_factor: float | None = None
    lr_group: int | None = None  # (lr[G]=: that group's rate alone)
    eps: float | None = None
    weight_decay: float | None = None
    clip: float | None = None
    dtype: torch.dtype | None = None
    drop: list[int] | None = None  # rows removed from the event step's batch
    drop_step: int | None = None
    drop_micro_batch: tuple[int, ...] | None = None  # (None: every micro-batch of that step)
    hyper: tuple[tuple[str, tuple[float, ...]], ...] = ()  # (Rprop's step_sizes, etas)


# a window whose steps ran forwards on weights the loop moved (recorder: ``weights_moved``)
MOVED_NOT_RERUN = ("the loop moved the weights in place between the forwards of {steps} (SAM's "
                   "ascent to w + e, undone before step()): the re-run does not repeat that "
                   "move, so their later forwards ran on the weights as they were and the "
                   "updates used the gradients there; the window and its what-ifs train as the "
                   "base optimizer alone, not as the loop did")


@dataclass
class WindowRun:
    first: Outcome | None
    per_step: list[dict[str, Any]]  # step, loss, grad_norm, param_norm, lr, skipped
    problems: list[str] = field(default_factory=list)
    raised: str | None = None  # the model's code raised (where and what): the run ended there
    state_noted: bool = False  # an update left the optimizer's state non-finite (a note)
    weight_norms: dict[int, dict[str, float]] = field(default_factory=dict)  # after updates


def window_of(step: Step) -> Window | None:
    """The bundle's rewind window, or None (no ``meta.rewind``, or nothing in it)."""
    rw = step.meta.get("rewind") or {}
    if not rw.get("records") or (step.event.get("evaluation")
                                 and step.event.get("phase") != "optimizer"):
        return None
    return Window("rewind/", int(rw["copy_step"]), rw["records"],
                  rw.get("optimizer"), True)


def step_as_window(step: Step) -> Window:
    """The bundle's own step as a window of one: its weights, batch, RNG and hyper-parameters."""
    opt = step.meta.get("optimizer") or {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.get("param_groups", [])]
    # a GradScaler event's step is re-run scaled, as its backward ran (unscaled, every try
    # would be finite whatever it changed)
    scale = scale_of_the_step(step) if step.event.get("kind") == "scale" else None
    record = {"step": step.event.get("step"), "rng": step.meta.get("rng"),
              "micro_batches": step.micro_batches, "hyper": groups, "scale": scale,
              "skipped": False, "rng_prefix": ""}
    return Window("", record["step"], [record], opt, False)


# -- a run ------------------------------------------------------------------------------------


def run_window(step: Step, win: Window, change: Change | None = None) -> WindowRun:
    """Restore the window's copy into the rebuilt model and optimizer and re-run its steps
    until the first non-finite value (or the end). ``step`` needs ``model`` (and
    ``optimizer`` for updates); its tensors are never modified."""
    change = change or Change()
    out = WindowRun(None, [], problems=_moved_note(step, win))
    _restore(step, win, change.dtype)
    opt = _stepped_optimizer(step, win, out.problems)
    peers = _peers(step, win, out.problems)
    factors: dict[int, list[float]] | None = {} if change == Change() else None
    for record in win.records:
        attributes_began(step, record.get("attrs"))  # (its schedule's; the loss's own)
        sub = _sub_step(step, win, record, change)
        runner = Runner(sub)
        runner.cast, runner.loss_factors = change.dtype, factors
        runner.feed_recorded = step.loss_fn is None  # (what entered from the loop's loss)
        # (no loss_fn, no gradient reached the output: the values the forward kept aside are
        # the loop's loss, as the style tutorial's modules' self.loss; see replay.kept_aside)
        runner.keep_aside = step.loss_fn is None and no_backward_reached_the_output(sub)
        scale = _used_scale(step, win, record)
        runner.loss_scale = scale if scale is not None and math.isfinite(scale) else None
        run = _run_ranks(runner, step, peers, record, change, scale)
        o = run_outcome(record["step"], run)
        if run.error is not None and o is None:
            out.raised = f"{run.raised} in the model's code at step {record['step']}"
            out.problems.append(f"the model's code raised {run.raised} at step "
                                f"{record['step']} of the re-run")
            break
        stats = _stats(record, run, change)
        out.per_step.append(stats)
        if o is not None:
            out.first = o
            break
        if scale is not None and math.isfinite(scale):
            unscale(step.model, scale)
        _drop_untrained(step.model, opt, record)
        bad_grads = [n for n, p in step.model.named_parameters()
                     if p.grad is not None and not finite(p.grad)]
        stats["grad_norm"] = total_norm(p.grad for p in step.model.parameters())
        if _skipped_again(step, record, scale, bad_grads):
            stats["skipped"] = True
            continue
        if bad_grads:
            out.first = Outcome(record["step"], "backward", params=bad_grads,
                                kind=kinds_of([p.grad for n, p in step.model.named_parameters()
                                               if n in bad_grads]))
            break
        if (used := loop_clip(step, win, record, change, stats["grad_norm"], ring_loss(run),
                              runner.step_factors)) is not None:
            stats["grad_norm"] = used  # (the loop's own unscaling: the norm its update used)
        # (the GradScaler's skips follow the re-run's own gradients, as in training)
        if opt is None or (record is win.records[-1] and not _last_update_ran(step, win)):
            stats["param_norm"] = total_norm(step.model.parameters())
            continue
        set_hyper(opt, record, sub, change)
        if _checked_update(step, opt, record["step"], change == Change(), out, stats):
            break
    win.loss_factors = win.loss_factors if factors is None else window_factors(factors)
    attributes_began(step, None)
    return out


def _moved_note(step: Step, win: Window) -> list[str]:
    """The note for steps of the window that ran forwards on weights the loop moved (SAM)."""
    moved = [r["step"] for r in win.records if r["step"] != step.event.get("step")
             and any(mb.get("weights_moved") for mb in r.get("micro_batches") or [])]
    if not moved:
        return []
    span = f"step {moved[0]}" if len(moved) == 1 else f"steps {moved[0]}-{moved[-1]}"
    return [MOVED_NOT_RERUN.format(steps=span)]


def _stepped_optimizer(step: Step, win: Window, problems: list[str]):
    """The optimizer the re-run steps after each step's backward, or None (with a note when
    the update matters): none rebuilt, or one whose ``step()`` needs a closure (LBFGS)."""
    opt = step.optimizer
    if opt is None and step.meta.get("optimizer"):
        problems.append("the optimizer could not be rebuilt, so the window's updates were "
                        "not re-run")
    if opt is not None and needs_closure(opt):
        if len(win.records) > 1 or step.event.get("phase") == "optimizer":
            problems.append(f"{type(opt).__name__}.step() takes a closure that evaluates the "
                            "whole step again, which the re-run cannot give it: its updates "
                            "were not re-run")
        return None
    return opt


def _drop_untrained(model, opt, record: dict[str, Any]) -> None:
    """Parameters that did not train in this step of the window, whose layers were unfrozen
    later, as the rebuilt model trains every one: those frozen then (``requires_grad_(False)``)
    and those of the groups the optimizer gained after it (``add_param_group``). Their
    re-run gradients are dropped before the loop's clipping and the update: training had
    none; or the zeros ``zero_grad(set_to_none=False)`` left (``frozen_grads``), which the
    update still steps (momentum, decay)."""
    frozen, zeros = set(record.get("frozen") or ()), set(record.get("frozen_grads") or ())
    for n, p in model.named_parameters():
        if n in frozen:
            p.grad = torch.zeros_like(p) if n in zeros else None
    n = len(record.get("hyper") or [])
    if opt is None or not n:
        return
    for group in opt.param_groups[n:]:
        for p in group["params"]:
            p.grad = None


def _used_scale(step: Step, win: Window, record: dict[str, Any]) -> float | None:
    """The scale the record's backward ran with. A step the GradScaler skipped is closed (and
    its scale read) after ``scaler.update()`` backed the scale off: undo the backoff, or the
    re-run backward would use half the scale and may not overflow where training did."""
    scale = record.get("scale")
    if scale is None or not record.get("skipped") or not win.from_rewind:
        return scale
    backoff = ((step.meta.get("rewind") or {}).get("grad_scaler") or {}).get("backoff_factor")
    return scale / backoff if backoff else scale


def _skipped_again(step: Step, record: dict[str, Any], scale: float | None,
                   bad_grads: list[str]) -> bool:
    """The re-run skips the record's update: the GradScaler skips it (its gradients overflowed),
    or the loop's own scaler skipped it in training (``end_step(skipped=True)``: skipped again,
    whatever the re-run's gradients). At a scale event's step that skip is the event itself
    (the skip that collapsed the scale), not a step trained past."""
    by_loop = scale is None and bool(record.get("skipped"))
    return (by_loop or bool(bad_grads) and scale is not None) and not _scale_event_at(step, record)


def _scale_event_at(step: Step, record: dict[str, Any]) -> bool:
    ev = step.event
    return ev.get("kind") == "scale" and ev.get("step") == record["step"]


# ---------------------------------------------------------------------------------------------
# the other ranks of a data-parallel run


def _peers(step: Step, win: Window, problems: list[str]) -> list[tuple[Step, Window]]:
    """The other ranks' bundles of a distributed event, each as a view of ``step`` (same model,
    loss and optimizer) with its own batches, RNG states and window: DDP (and FSDP) updated
    the weights with the gradients averaged over the ranks, so a re-run's updates from this
    rank's batches alone drift from training's at the first update (the losses of the steps
    after it differ from the recorded ones). Empty for one process, or when the window re-runs
    no update; a rank's bundle that is not beside it is a note and the run goes on with this
    rank's gradients."""
    from recorder.bundle import read_bundle

    from .shards import ranks_of, shard_set

    ranks = ranks_of(step.meta)
    if ranks is None or int(ranks.get("world_size") or 1) < 2 or step.optimizer is None:
        return []
    mine = int(ranks["rank"])
    found = shard_set(step.path, step.meta)
    lost = [r for r in range(int(ranks["world_size"])) if r not in found]
    if lost:
        problems.append(f"the bundles of rank(s) {lost} are not beside this one, so the "
                        "re-run's updates use the gradients of the ranks found only, not "
                        "training's average over every rank: copy every rank's bundle of "
                        "the step beside it")
    out = []
    for r, path in sorted(found.items()):
        if r == mine:
            continue
        meta, tensors = read_bundle(path)
        peer = dataclasses.replace(step, path=path, meta=meta, tensors=tensors, problems=[])
        pwin = window_of(peer) if win.from_rewind else step_as_window(peer)
        if pwin is not None:  # (the same loop ran on every rank)
            pwin.loss_factors = win.loss_factors
        if pwin is None or [x["step"] for x in pwin.records] != [x["step"] for x in win.records]:
            problems.append(f"rank {r}'s bundle holds other steps than this one's window, so "
                            "its gradients are left out of the re-run's updates")
            continue
        out.append((peer, pwin))
    return out


def _run_ranks(runner: Runner, step: Step, peers, record: dict[str, Any], change: Change,
               scale: float | None):
    """``runner``'s run of this rank's micro-batches of ``record``, its gradients averaged
    with the other ranks' (``peers``, see :mod:`replay.peers`), as the all-reduce did."""
    others = peer_gradients(step, peers, record, change, scale, _sub_step)
    runner.nonfinite_forwards = nonfinite_forwards(step, record["step"])
    run = runner.run()
    if others is not None:  # the update uses every rank's gradients, averaged
        average_gradients(step.model, others, len(peers) + 1)
    return run


def _last_update_ran(step: Step, win: Window) -> bool:
    """Whether the window's last recorded step's update is part of the run: for a rewind
    window, the last record is the step during which the event was detected, whose update
    never ran (the recorder stops before it) unless the event is the update of that very
    step; for a bundle's own step, the update is re-run (the what-if of an update)."""
    ev = step.event
    last = win.records[-1]["step"]
    if not win.from_rewind:
        return step.meta.get("state") != "after_update"
    return ev.get("phase") == "optimizer" and ev.get("step") == last


def matches_event(step: Step, o: Outcome | None) -> bool:
    """The run's first non-finite value is the recorded event: same step, same phase."""
    if o is None:
        return False
    ev = step.event
    phase = {"optimizer": "update"}.get(ev.get("phase"), ev.get("phase"))
    if o.step != ev.get("step") or o.phase != phase:
        return False
    return phase != "forward" or ev.get("module") in (None, o.module) or bool(ev.get("compiled"))


# ---------------------------------------------------------------------------------------------
# state


def _restore(step: Step, win: Window, dtype: torch.dtype | None) -> None:
    """Weights, buffers and optimizer state from the copy, as fresh tensors (the bundle's are
    never written), cast to ``dtype`` when a what-if changes the compute dtype."""
    t, dev, model = step.tensors, step.device, step.model

    def fresh(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dev, copy=True)
        return x.to(dtype) if dtype is not None and x.is_floating_point() else x

    with torch.no_grad():
        for n, p in model.named_parameters():
            key = f"{win.prefix}weights/{n}"
            if key in t:
                p.data = fresh(t[key])
            p.grad = None
        for n, b in model.named_buffers():
            key = f"{win.prefix}buffers/{n}"
            if key in t and restorable(model, n, t[key], b):
                b.data = fresh(t[key])
    opt = step.optimizer
    if opt is None:
        return
    clear_state(opt)
    names = dict(model.named_parameters())
    scalars = (win.optimizer or {}).get("state_scalars", {})
    prefix = f"{win.prefix}optim/"
    states: dict[str, dict[str, Any]] = {}
    for key, v in t.items():
        if key.startswith(prefix):
            name, _, k = key[len(prefix):].rpartition("/")
            # Adam's step counter stays as it was (a float32 tensor), moments follow ``dtype``
            states.setdefault(name, {})[k] = fresh(v) if k != "step" else v.to(dev, copy=True)
    for name, st in scalars.items():  # (a tuple of tensors back as one, copied)
        states.setdefault(name, {}).update({k: load_seq(v, t, dev, copy=True)
                                            for k, v in st.items()})
    for name, st in states.items():  # (ZeRO's ``optim::`` keys, for its local Adam rebuilt)
        if name in names:
            put_state(opt, names[name], as_rebuilt(step.meta.get("optimizer"), opt, st))


def _sub_step(step: Step, win: Window, record: dict[str, Any], change: Change) -> Step:
    """``step`` seen as the record's step: its micro-batches and RNG (a shallow view)."""
    tensors = dict(step.tensors)
    rng_prefix = record.get("rng_prefix", f"rewind/step/{record['step']}/")
    if rng_prefix:
        for k in [k for k in tensors if k.startswith(rng_prefix + "rng/")]:
            tensors[k[len(rng_prefix):]] = tensors[k]
    mbs = record["micro_batches"]
    if change != Change() and step.loss_fn is not None:
        # a faithful re-run may use the recorded output gradients; a what-if must not: they
        # are the recorded run's (its backward starts from its own loss, times the loop's)
        mbs = with_factors(mbs, win.loss_factors)
    if change.drop and record["step"] == change.drop_step:
        i, mbs = change.drop_micro_batch, [dict(mb) for mb in mbs]  # (copies: see drop_rows)
        # the samples the report names are rows of one micro-batch (and of those one loss
        # compares with it: views of the same images): others' rows are other samples. With
        # no loss to re-run (computed in the loop), the backward starts from the recorded output
        # gradients less the dropped rows: stripped, no backward ran and every drop was "finite"
        drop_rows(tensors, mbs if i is None else [mbs[j] for j in i if 0 <= j < len(mbs)],
                   change.drop, step.model, out_grads=step.loss_fn is None)
    meta = {**step.meta, "micro_batches": mbs, "rng": record.get("rng")}
    if meta["rng"] is None:
        meta.pop("rng")
    return dataclasses.replace(step, meta=meta, tensors=tensors, problems=[])


def _checked_update(step: Step, opt, at: int, unchanged: bool, out: WindowRun,
                    stats: dict[str, Any]) -> bool:
    """Step ``opt``, checked as the recorder checks an update: its weights. True when it left
    them non-finite (``out.first`` is then that update's outcome). An optimizer state it left
    non-finite with the weights finite (Adam's exp_avg_sq of a gradient past float32's range)
    is no event in training, which trained on: the unchanged re-run notes it once."""
    before = saved_start(step.model, opt)
    scales = WeightScales(step.model)
    try:
        with scales if unchanged else contextlib.nullcontext():
            opt.step()
    except Exception as e:  # (a decomposition the update raised, as training's did: its event)
        if linalg_reason(e) is None:
            raise
        restore_start(step.model, opt, before)
        out.first = Outcome(at, "update", kind="linalg", domain=error_text(e))
        return True
    if scales.found is not None:  # (a factor >= 1 in magnitude: see replay.weight_scale)
        stats["weight_scale"] = scales.found
    stats["param_norm"] = total_norm(step.model.parameters())
    if bad := [n for n, p in step.model.named_parameters()
               if not p.is_meta and not finite(p)]:  # (a placeholder holds no value)
        out.first = _update_outcome(at, step, opt, before, bad)
        return True
    if step.event.get("state") and (stale := stale_state(step.model, opt)) is not None:
        # (a state event: training checked this update's state, so the re-run and tries do)
        out.first = Outcome(at, "update", params=[stale[0]], kind=stale[2], state=stale[1])
        return True
    if unchanged:  # (each parameter's, against the recorder's evidence of training's update)
        out.weight_norms[at] = param_norms(step.model)
    if unchanged and not out.state_noted and (note := state_note(at, step.model, opt)):
        out.problems.append(note)
        out.state_noted = True
    return False


def _update_outcome(k: int, step: Step, opt, before, bad: list[str]) -> Outcome:
    """Re-run the bad update from its starting state under the op finder, with the
    per-parameter implementation (fused and foreach kernels make many values in one op)."""
    model = step.model
    restore_start(model, opt, before)
    why = zero_scale_why(model, opt)  # (a quantised state's NaN codes, before the update)
    rate = finite_at_a_rate(model, opt)  # (every lr 0: finite at one > 0?)
    finder = OpFinder()
    with per_parameter(opt), finder:
        opt.step()
    hit = finder.origin()
    params = dict(model.named_parameters())
    return Outcome(k, "update", params=bad, kind=kinds_of([params[n] for n in bad]),
                   op=hit.op if hit else None, source=hit.source if hit else None,
                   chain=finder.chain(), domain=update_domain(hit), stale_why=why,
                   zero_rate=rate)


def _stats(record: dict[str, Any], run, change: Change) -> dict[str, Any]:
    """A step's line of the window's ``per_step`` (norms filled in as the step goes on), with
    every parameter group's learning rate when there are several."""
    lrs = _lrs(record, change)
    return {"step": record["step"], "loss": loss_value(run), "lr": (lrs or [None])[0],
            "grad_norm": None, "param_norm": None, "skipped": False,
            **({"group_lrs": lrs} if len(lrs) > 1 else {})}


def _lrs(record: dict[str, Any], change: Change) -> list[float | None]:
    """Each parameter group's learning rate in the record's update, as the change sets it."""
    out: list[float | None] = []
    for i, g in enumerate(record.get("hyper") or []):
        v = g.get("lr")
        v = float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None
        out.append(None if v is None else new_lr(v, i, change))
    return out
