"""Turning a non-finite step row into an :class:`Event`: which phase, module, call, tensor, samples.

Runs only on the slow path, after the step's single sync said something is not finite, so it
may read whatever it needs from the device. :func:`find_event` asks one finder per phase, in
the order a value flows: the last update, weights, input, forward, loss, backward.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .batch_tensors import data_tensors, first_bad_tensor, output_tensors
from .capture import batch_path, loss_path
from .chain import chain_origin, returned_infinity
from .constants import unchanged
from .finite import (
    finite,
    flags_kind,
    inf_read_finite,
    kind_of,
    only_mask_infinities,
    pair_kind,
    pair_ok,
)
from .kept_targets import kept_targets_moved
from .late_writes import read_finite, written_after_forward
from .linalg import linalg_detail
from .loss_data import loss_data_taken
from .missing import rest_finite, root_input_name
from .own_code import own_code_detail
from .ring import decode_call
from .samples import packed_in
from .self_written import WRITTEN_DETAIL, self_written
from .shards import local
from .step_evidence import StepEvidence
from .superseded_norms import only_superseded_overflow
from .tape import fed_to

__all__ = ["Event", "find_event", "optimizer_event", "output_grad_bad"]

# keys a bundle's event holds only when they are set
UNIDENTIFIED = "non-finite statistic with no identifiable source"
_OPTIONAL = ("after_update", "first_seen_step", "last_update_step", "evaluation", "compiled",
             "ranks", "written_after_forward", "before_update", "nan_handled", "loss_given",
             "batch_size", "no_step_closed", "state", "statistic", "no_backward")


@dataclass
class Event:
    """The first offender of a step. :meth:`as_dict` is the bundle's ``event`` and
    :attr:`~recorder.FlightRecorder.event` (keys in this order; optional ones only when set)."""

    step: int
    reason: str = "non_finite"  # or "scale_collapse", "scale_skipping", "peer"
    phase: str | None = None  # weights, input, forward, loss, backward, optimizer, peer
    module: str | None = None  # the module's name ("" the root, "<loss>" the loss)
    module_type: str | None = None
    call: int | None = None  # which call of that module in its micro-batch
    micro_batch: int | None = None
    inputs_finite: bool | None = None
    kind: str | None = None  # "nan", "+inf", "-inf", "inf" (sign unknown), "scale"
    params: list[str] = field(default_factory=list)
    tensor: str | None = None  # the batch or loss-input path holding it
    samples: list[int] = field(default_factory=list)
    after_update: bool | None = None  # optimizer events: the bundle holds the state after it
    detail: str = ""
    first_seen_step: int | None = None
    last_update_step: int | None = None
    evaluation: bool | None = None  # in an evaluation forward between steps
    # ...one with gradients on that no backward followed: the loop's last forwards after its
    # last update (a metric taken outside no_grad), checked as the recorder detached
    no_backward: bool | None = None
    compiled: bool | None = None  # the module is a torch.compile'd region
    # under torch.distributed: run id, rank, world size, who saw it (recorder.ranks)
    ranks: dict[str, Any] | None = None
    # parameters the loop made non-finite after the forward read them (see late_writes)
    written_after_forward: list[str] | None = None
    before_update: bool | None = None  # (those written after backward: recorder.pre_update)
    # the root input (allow_nan's name) whose NaN the rest of the step shows the model handled
    nan_handled: str | None = None
    # the loss given to record_loss is non-finite, loss_fn's of the micro-batch was finite
    loss_given: bool | None = None
    batch_size: int | None = None  # the micro-batch's samples, when ``samples`` names some
    no_step_closed: bool | None = None  # an update whose step() closed none (recorder.alarm)
    state: dict[str, list[str]] | None = None  # its non-finite state keys (state_check)
    statistic: str | None = None  # the running statistic it wrote (recorder.running_stats)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in _OPTIONAL}


def find_event(ev: StepEvidence, reason: str) -> Event | None:
    """The first offender of a step, in the order a value flows: weights (left by the last
    update), input, forward, loss, backward. None when the only non-finite statistics were
    norms of huge but finite tensors that overflowed (no event)."""
    ev.layout.materialize()
    if reason == "anomaly":
        return Event(ev.tape.step, reason, phase="backward", kind="nan", detail=(
            "torch.autograd's anomaly mode stopped backward at a NaN gradient, before any "
            "reached a parameter"))
    if reason == "linalg":  # (the module and op are the replay's: no hook saw the raise)
        return Event(ev.tape.step, reason, phase=ev.tape.linalg_phase,
                     detail=linalg_detail(ev.tape))
    if reason in ("constraint", "check"):  # (likewise: recorder.constraints, numeric_check)
        return Event(ev.tape.step, reason, phase=ev.tape.linalg_phase if reason == "check"
                     else "forward", detail=ev.tape.refused)
    if reason in ("scale_collapse", "scale_skipping"):
        scale = ev.layout.scale
        return Event(ev.tape.step, reason, phase="backward", kind="scale", detail=(
            f"GradScaler scale {scale} after skipping steps (reason {reason})"
            if scale is not None else "the loop's own loss scaler skipped more than "
            "max_skipped_steps updates in a row (end_step(skipped=True))"))
    ev.calls = [decode_call(ev.row, c) for c in ev.layout.calls]
    for finder in (_update_event, _weights_event):
        if (event := finder(ev)) is not None:
            if ev.late:  # (and those it wrote after the forward read them finite)
                event.written_after_forward = [ev.param_names[i] for i in ev.late]
            return event
    # a step's forwards and losses in the order they ran: micro-batch k's loss came before
    # micro-batch k + 1's forward, which may have used it (a MAML inner loop's update)
    found = [e for e in (_input_event(ev), _forward_event(ev), _loss_event(ev)) if e is not None]
    event = min(found, key=lambda e: e.micro_batch or 0) if found else _backward_event(ev)
    if event is not None:  # (stable: input, forward, loss)
        if event.samples and event.micro_batch is not None:  # ("all 32 samples": see summary)
            event.batch_size = ev.samples(event.micro_batch).size or None
        if ev.late:
            event.written_after_forward = [ev.param_names[i] for i in ev.late]
        return event
    if ev.overflowed or ev.returned_inf or only_superseded_overflow(ev):
        return None  # only norms of huge but finite weights or gradients overflowed
    return _written_event(ev) or _raised_root_input(ev) or Event(
        ev.tape.step, phase="forward", detail=UNIDENTIFIED)


def _written_event(ev: StepEvidence) -> Event | None:
    """Weights the step's own code made non-finite in place (see recorder.self_written)."""
    found = self_written(ev.param_tensors, ev.param_names, ev.changed)
    return found and Event(ev.tape.step, phase="forward", kind=found[1], params=found[0],
                           detail=WRITTEN_DETAIL.format(name=found[0][0]))


def _update_event(ev: StepEvidence) -> Event | None:
    """The last update's evidence (its weights' norms right after it) shows non-finite
    weights: the update made them. Weights come first: they were in place before this step
    began, and NaN weights make every later check fail too."""
    layout = ev.layout
    really = ev.really_bad(layout.updates, grads=False)
    if not really:
        return None
    return optimizer_event(layout.update_step, [ev.param_names[i] for i in really],
                           after_update=True, kind=ev.kind(really, layout.updates))


def _weights_event(ev: StepEvidence) -> Event | None:
    """Weights already non-finite when the step began (not made by the last update)."""
    layout, tape = ev.layout, ev.tape
    really = [i for i in ev.really_bad(layout.params, grads=False) if i not in ev.changed]
    bad_input = any(d["module"] == 0 and not d["inputs_finite"] for d in ev.calls)
    if ev.param_tensors is not None and not bad_input:
        # weights whose norms the step did not record: read them (bad data, when there is
        # some, is blamed first: it is certain, and another thread may be updating weights)
        recorded = {i for i, _ in layout.params} | ev.changed
        really += [i for i, p in enumerate(ev.param_tensors) if i not in recorded
                   and not finite(local(p).detach()) and not unchanged(ev.constants, i, p)]
    if ev.weights_moved:  # (their modules returned finite values: the write came after)
        ev.late = written_after_forward(really, ev.param_names, ev.module_names, ev.calls)
        if len(ev.late) < len(really):  # (some bad as it began: only those read finite late)
            ev.late = read_finite(ev.late, ev.param_names, ev.module_names, ev.calls)
        really = [i for i in really if i not in ev.late]
    if not really:
        return None
    bad = [ev.param_names[i] for i in really]
    kind = ev.kind(really, layout.params)
    left_finite = {i for i, _ in layout.updates}  # finite right after the last update
    if ev.params_from_update and not left_finite:  # an update ran, with no evidence of it
        return optimizer_event(tape.step - 1, bad, after_update=True, kind=kind)
    event = Event(tape.step, phase="weights", params=bad, kind=kind, first_seen_step=tape.step,
                  detail=f"non-finite values already in {len(bad)} parameter(s), first "
                         f"{bad[0]}, first seen at step {tape.step}")
    if left_finite and all(i in left_finite for i in really):
        # finite right after the last update, non-finite now: written outside it
        event.last_update_step = layout.update_step
        event.detail += (f"; the last update (step {layout.update_step}) left them finite, so "
                         "they were written outside optimizer.step() since (an in-place edit, "
                         "a checkpoint load, a bit flip)")
    return event


def _call_event(ev: StepEvidence, d: dict[str, Any], phase: str) -> Event:
    """An event at decoded call ``d``, numbered among its module's calls in its micro-batch."""
    call = sum(1 for o in ev.calls if o["module"] == d["module"]
               and o["micro_batch"] == d["micro_batch"] and o["order"] < d["order"])
    return Event(ev.tape.step, phase=phase, module=ev.module_names[d["module"]],
                 module_type=ev.module_types[d["module"]], call=call,
                 micro_batch=d["micro_batch"], inputs_finite=d["inputs_finite"],
                 kind=flags_kind(d["nan"], d["posinf"], d["neginf"]) or "-inf")


def _batch_event(ev: StepEvidence, d: dict[str, Any], nan_only: bool) -> Event:
    """Bad data: the root call ``d``'s inputs held the value."""
    mb = ev.tape.micro_batches[d["micro_batch"]]
    outs = [t for m in ev.tape.micro_batches[:d["micro_batch"]] for t in data_tensors(m.outputs)]
    found = first_bad_tensor([list(mb.args), mb.kwargs], ev.samples(d["micro_batch"]),
                              nan_only=nan_only, model=(outs, ev.param_tensors))  # (G's images)
    event = _call_event(ev, d, "input")
    if found:
        event.tensor, event.samples, event.kind = batch_path(found[0], len(mb.args)), *found[1:]
        if event.kind == "nan" and rest_finite(ev.row, ev.calls, ev.layout):
            event.nan_handled = root_input_name(found[0])
        elif d["inputs_finite"] and not d["inputs_nan_free"]:  # an allow_nan input's got past
            out = ev.samples(d["micro_batch"]).first_rows(output_tensors(mb.outputs),
                                                        packed_in(mb.outputs), stacked=True)
            event.samples = [r for r in event.samples if r in out] or event.samples
    event.detail = f"non-finite value in the model's input {event.tensor or ''}".rstrip()
    if not found and mb.inputs_changed:  # (the loop wrote over it: the stats saw it as it ran)
        event.detail = ("non-finite value in the model's input, which the loop wrote into "
                        "after the forward (the bundle holds it as the loop left it)")
    return event


def _input_event(ev: StepEvidence) -> Event | None:
    """The root call's inputs: NaN; +-Inf too with ``strict_inf`` (else see chain.chain_origin)."""
    for d in ev.calls:
        if d["module"] == 0 and not d["inputs_finite"]:
            return _batch_event(ev, d, nan_only=not ev.strict_inf)
    return None


def _forward_event(ev: StepEvidence) -> Event | None:
    """The first call (in completion order) to make a non-finite output from finite inputs: a
    parent's own code counts, a module that passed a NaN on does not."""
    if ev.strict_inf:
        bad = [d for d in ev.calls if not d["outputs_finite"]
               and not (d["module"] in ev.allowed and not d["nan"])]
        # (finite inputs holding NaN: an allow_nan input's, which is no call's making)
        made = [d for d in bad if d["inputs_finite"] and (d["inputs_nan_free"] or not d["nan"])]
        d = (made[0] if made else bad[0]) if bad else None
        root = next((r for r in ev.calls if r["module"] == 0 and not r["inputs_nan_free"]
                     and r["micro_batch"] == d["micro_batch"]), None) if d and not made else None
        if root is not None:  # that NaN got past the model's handling
            return _batch_event(ev, root, nan_only=True)
    else:
        by_order = sorted(ev.calls, key=lambda d: (d["micro_batch"], d["order"]))
        masked = {i for i, mb in enumerate(ev.tape.micro_batches)
                  if only_mask_infinities(data_tensors([list(mb.args), mb.kwargs]))}
        d, came_in = chain_origin(by_order, ev.allowed, ev.module_names, masked, ev.rewritten)
        if came_in:
            return _batch_event(ev, d, nan_only=False)
        if d is not None and returned_infinity(ev.tape.evaluation, bool(ev.layout.loss),
                                               ev.calls):
            ev.returned_inf = True
            return None
    if d is None:
        return None
    if (data := loss_data_taken(ev, d)) is not None:  # (a module the loss called took it)
        return Event(ev.tape.step, phase="input", module="<loss>", micro_batch=d["micro_batch"],
                     tensor=data[0], samples=data[1], kind=data[2], detail=(
                         f"non-finite value in the loss target {data[0]}, taken in by "
                         f"{ev.module_names[d['module']]}, which the loss called"))
    if (root := _unfinished_root(ev, d)) is not None:
        if not root["inputs_finite"]:
            return _batch_event(ev, root, nan_only=not ev.strict_inf and not root["inf_in"])
        d = root
    event = _call_event(ev, d, "forward")
    if ev.tape.micro_batches:
        mb = d["micro_batch"]
        outputs = ev.tape.micro_batches[mb].outputs
        outs = output_tensors(outputs)  # (NaN rows only, where allow_inf lets the root hold +-inf)
        event.samples = ev.samples(mb).first_rows(
            inf_read_finite(outs) if 0 in ev.allowed else outs, packed_in(outputs), stacked=True)
    event.detail = (f"{event.kind} first in the output of {event.module or '<root>'} "
                    f"({event.module_type}), call {event.call}")
    own_code_detail(event, ev.calls, d, ev.module_names)  # (its output finite)
    return event


def _loss_event(ev: StepEvidence) -> Event | None:
    """A non-finite loss: from its targets (bad data), else made by the loss itself."""
    row = ev.row
    for k, (mb_i, lo, hi) in enumerate(ev.layout.loss):
        if pair_ok(row[lo], row[hi]):
            continue
        mb = ev.tape.micro_batches[mb_i]
        mb.select_loss_call(k)  # (a loop calling the loss again: the call that went bad)
        outs = list(data_tensors(mb.outputs))
        found = first_bad_tensor([list(mb.loss_args or ()), mb.loss_kwargs or {}],
                                  ev.samples(mb_i), skip=outs, model=(outs, ev.param_tensors))
        event = Event(ev.tape.step, micro_batch=mb_i, module="<loss>",
                      kind=pair_kind(row[lo], row[hi]))
        if found:
            path = loss_path(found[0])
            event.phase, event.tensor, event.samples, event.kind = "input", path, *found[1:]
            event.detail = f"non-finite value in the loss target {path}"
        else:
            event.phase = "loss"  # (an output's +-Inf here is one allow_inf let through)
            held = "holds no NaN (its +-Inf, allowed, reached the loss)" if any(
                not finite(t) for t in outs if t.is_floating_point()) else "is finite"
            event.detail = f"the loss is non-finite while the model output {held}"
            if k in ev.tape.given_loss and any(  # (loss_fn ran first, finite: k is the first)
                    m == mb_i and j not in ev.tape.given_loss
                    for j, (m, _, _) in enumerate(ev.layout.loss[:k])):
                event.loss_given = True
                event.detail = ("the loss given to record_loss is non-finite while loss_fn's "
                                "loss was finite: a term the loop added to it made the value")
            if mb.targets_changed and kept_targets_moved(mb):  # (the loop wrote over them)
                event.detail += (", and the loop wrote into the loss's targets after the loss "
                                 "took them (the bundle holds them as the loop left them)")
        return event
    return None


def _backward_event(ev: StepEvidence) -> Event | None:
    bad: dict[int, set[int]] = {}  # micro-batch -> its root outputs given a bad gradient
    for mb_i, i, k in ev.layout.out_grads:
        if not math.isfinite(ev.row[k]):
            bad.setdefault(mb_i, set()).add(i)
    for mb_i, outs in bad.items():  # (a loop calling the loss again: the call that made it)
        ev.tape.micro_batches[mb_i].select_loss_call_of(outs)
    really = ev.really_bad(ev.layout.grads, grads=True)
    if not really:
        return _output_grad_event(ev)
    bad = [ev.param_names[i] for i in really]
    return Event(ev.tape.step, phase="backward", params=bad,
                 kind=ev.kind(really, ev.layout.grads, grads=True),
                 detail=f"non-finite gradient in {len(bad)} parameter(s), first {bad[0]}")


def _output_grad_event(ev: StepEvidence) -> Event | None:
    """Every parameter's gradient is finite, but the one backward brought to a root output is
    not: a loss computed where the recorder cannot see it (``log`` of a ReLU output that is 0,
    whose gradient ReLU then masks) that trains on while its value is non-finite."""
    for mb_i, i, k in ev.layout.out_grads:
        if math.isfinite(ev.row[k]):
            continue
        grad = ev.tape.micro_batches[mb_i].out_grads.get(i)
        if grad is not None and finite(grad):
            ev.overflowed = True  # a huge but finite gradient whose squared norm overflowed
            continue
        event = Event(ev.tape.step, phase="backward", micro_batch=mb_i,
                      tensor="grad of the model output" + (f" [{i}]" if i else ""),
                      kind="inf" if grad is None else kind_of(grad) or "inf",
                      samples=[] if grad is None else ev.samples(mb_i).rows(grad))
        event.detail = _output_grad_detail(ev, mb_i)
        return event
    return None


def _output_grad_detail(ev: StepEvidence, mb_i: int) -> str:
    """What the recorder can say of a non-finite gradient entering micro-batch ``mb_i``'s
    output: a finite loss_fn loss means the loss's backward made it (a loss differentiated
    with torch.autograd.grad, not backward(), writes no parameter's gradient at all)."""
    grads = ("every parameter's gradient is finite" if ev.layout.grads else
             "no parameter's gradient was written (torch.autograd.grad, not backward())")
    later = next((i for i, m in enumerate(ev.tape.micro_batches) if i > mb_i
                  and m.grads_dropped), None)
    if later is not None:  # (a zero_grad with no step(): an update the loop skipped)
        grads += f" (the loop dropped micro-batch {mb_i}'s before micro-batch {later})"
    head = f"non-finite gradient entering the model output (micro-batch {mb_i}) while {grads}"
    if (fed := fed_to(ev.tape.micro_batches, mb_i)) is not None:
        return (f"{head}: micro-batch {fed} took that output as its input (a rollout feeding "
                "the model its own output), so its backward may have sent it")
    if any(m == mb_i for m, _, _ in ev.layout.loss):
        return (f"{head}: the loss from loss_fn is finite, so its backward made it (a "
                "derivative's pole: sqrt or a norm at 0, a division)")
    return f"{head}: the loss, computed outside the recorder, or its backward made it"


def output_grad_bad(ev: StepEvidence) -> bool:
    """Some gradient backward brought to a root output holds a NaN/Inf: this rank's own loss
    made it (under DDP or FSDP2 the parameters' gradients may hold another rank's NaN, which
    the all-reduce or reduce-scatter spread; the output's gradient is never exchanged)."""
    for mb_i, i, k in ev.layout.out_grads:
        if not math.isfinite(ev.row[k]):
            grad = ev.tape.micro_batches[mb_i].out_grads.get(i)
            if grad is None or not finite(grad):
                return True
    return False


def _unfinished_root(ev: StepEvidence, d: dict[str, Any]) -> dict[str, Any] | None:
    """The root call of ``d``'s micro-batch as a decoded call when ``d`` took in a value no
    call made and the root never returned (it raised: a distribution's ``validate_args``
    refusing the NaN): its own code made the value, or the batch brought it (then its
    ``inputs_finite`` is False); None otherwise, or when the batch holds only +-Inf that the
    default policy may intend."""
    mb = d["micro_batch"]
    if d["inputs_finite"] or d["module"] == 0 or mb >= len(ev.tape.micro_batches) or any(
            c["module"] == 0 and c["micro_batch"] == mb for c in ev.calls):
        return None
    m = ev.tape.micro_batches[mb]
    batch = [list(m.args), m.kwargs]
    came = first_bad_tensor(batch, ev.samples(mb), nan_only=not ev.strict_inf)
    # (+-Inf no mask explains is the data's, as chain_origin reads a root that returned)
    inf_in = not came and not only_mask_infinities(data_tensors(batch))
    came = came or (first_bad_tensor(batch, ev.samples(mb)) if inf_in else None)
    if m.outputs is not None or (not came and first_bad_tensor(batch, ev.samples(mb))):
        return None
    return {**d, "module": 0, "order": max(c["order"] for c in ev.calls) + 1, "inf_in": inf_in,
            "inputs_finite": not came, "inputs_all_finite": not came, "inputs_nan_free": not came}


def _raised_root_input(ev: StepEvidence) -> Event | None:
    """The batch of a micro-batch whose root call raised before it returned (Pyro's validation
    refusing a NaN ``obs`` in the ELBO's ``compute_log_prob``), holding NaN in a tensor no
    hooked call took in, so no call's statistics show it: an input event, as a root that
    returned would have made it."""
    if not ev.tape.cut_short:
        return None
    for mb, m in enumerate(ev.tape.micro_batches):
        if m.outputs is not None or any(c["module"] == 0 and c["micro_batch"] == mb
                                        for c in ev.calls):
            continue
        if first_bad_tensor([list(m.args), m.kwargs], ev.samples(mb), nan_only=True):
            order = max((c["order"] for c in ev.calls), default=-1) + 1
            return _batch_event(ev, {"module": 0, "micro_batch": mb, "order": order,
                                     "inputs_finite": False, "inputs_nan_free": False,
                                     "nan": True, "posinf": None, "neginf": None},
                                nan_only=True)
    return None


def optimizer_event(step: int, params: list[str], *, after_update: bool,
                    kind: str = "nan") -> Event:
    """An update that turned finite weights non-finite. ``after_update``: the bundle holds the
    state after it (caught at the next step), not before (caught by ``guard_optimizer``)."""
    return Event(step, phase="optimizer", inputs_finite=True, kind=kind, params=params,
                 after_update=after_update,
                 detail=f"optimizer.step() made {len(params)} parameter(s) non-finite, first "
                        f"{params[0]}")
