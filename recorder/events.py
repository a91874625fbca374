"""Turning a non-finite step row into an event: which phase, module, call, tensor, samples.

Runs only on the slow path, after the step's single sync said something is not finite, so it
may read whatever it needs from the device.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .capture import batch_path, flatten_tree, loss_path
from .ring import StepLayout, decode_call
from .tape import Tape


def _kind(d: dict[str, Any]) -> str:
    if d["nan"]:
        return "nan"
    if d["posinf"]:
        return "+inf"
    return "-inf"


def bad_rows(t: torch.Tensor) -> list[int]:
    """Indices along dim 0 holding a non-finite value (all of a 0-d/1-row tensor: [0])."""
    if not t.is_floating_point() and not t.is_complex():
        return []
    bad = ~torch.isfinite(t.detach())
    if t.dim() == 0:
        return [0] if bool(bad) else []
    return bad.reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()


def _first_bad_tensor(obj: Any, prefix: str, skip=(), nan_only: bool = False
                      ) -> tuple[str, list[int], str] | None:
    _, tensors, paths = flatten_tree(obj, "x")
    for key, t in tensors.items():
        if any(t is s for s in skip) or t.grad_fn is not None:
            continue  # the model output, or computed from it: not data
        if nan_only and not (t.is_floating_point() and bool(torch.isnan(t.detach()).any())):
            continue
        rows = bad_rows(t)
        if rows:
            flat = t.detach()[~torch.isfinite(t.detach())]
            kind = "nan" if torch.isnan(flat).any() else ("+inf" if (flat > 0).any() else "-inf")
            return prefix + paths[key], rows, kind
    return None


def find_event(row: list[float], layout: StepLayout, tape: Tape, *, reason: str,
               module_names: list[str], module_types: list[str], param_names: list[str],
               params_from_update: bool, allowed: set[int],
               param_tensors: list[torch.Tensor] | None = None,
               strict_inf: bool = True) -> dict[str, Any] | None:
    """The first offender of a step, in the order a value flows: weights (left by the last
    update), input, forward, loss, backward. ``param_tensors`` (the live parameters, in
    ``param_names`` order) lets a gradient or weight event tell +Inf from -Inf, and tells a
    squared norm that overflowed float32 (finite values above ~1.8e19) from a non-finite
    tensor: None when such overflows were the only non-finite statistics (no event)."""
    ev: dict[str, Any] = {"step": tape.step, "reason": reason, "phase": None, "module": None,
                          "module_type": None, "call": None, "micro_batch": None,
                          "inputs_finite": None, "kind": None, "params": [], "tensor": None,
                          "samples": [], "detail": ""}
    layout.materialize()
    if reason in ("scale_collapse", "scale_skipping"):
        ev.update(phase="backward", kind="scale",
                  detail=f"GradScaler scale {layout.scale} after skipping steps "
                         f"(reason {reason})")
        return ev
    # 0. weights: made by the last update, or already there. They were in place before this
    #    step began, so they come first: NaN weights make every later check fail too (the
    #    first Linear's output, the loss, the gradients) and would be blamed on those.
    #    The last update's evidence (its weights' norms right after it) says which.
    overflowed = False
    bad_idx = [i for i, k in layout.updates if not math.isfinite(row[k])]
    really = _really_non_finite(bad_idx, param_tensors, grads=False)
    overflowed |= len(really) < len(bad_idx)
    if really:
        kind = (tensors_kind([param_tensors[i] for i in really]) if param_tensors is not None
                else None) or _param_kind(row, layout.updates)
        return optimizer_event(layout.update_step, [param_names[i] for i in really],
                               after_update=True, kind=kind)
    left_finite = {i for i, _ in layout.updates}  # finite right after the last update
    bad_idx = [i for i, k in layout.params if not math.isfinite(row[k])]
    really = _really_non_finite(bad_idx, param_tensors, grads=False)
    overflowed |= len(really) < len(bad_idx)
    calls = [decode_call(row, c) for c in layout.calls]
    bad_input = any(d["module"] == 0 and not d["inputs_finite"] for d in calls)
    if param_tensors is not None and not bad_input:
        # weights whose norms the step did not record: read them (bad data, when there is
        # some, is blamed first: it is certain, and another thread may be updating weights)
        recorded = {i for i, _ in layout.params}
        really += [i for i, p in enumerate(param_tensors) if i not in recorded
                   and p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
    bad_params = [param_names[i] for i in really]
    if bad_params:
        kind = (tensors_kind([param_tensors[i] for i in really]) if param_tensors is not None
                else None) or _param_kind(row, layout.params, param_tensors)
        if params_from_update and not left_finite:  # an update ran, with no evidence of it
            return optimizer_event(tape.step - 1, bad_params, after_update=True, kind=kind)
        ev.update(phase="weights", params=bad_params, kind=kind, first_seen_step=tape.step,
                  detail=f"non-finite values already in {len(bad_params)} parameter(s), first "
                         f"{bad_params[0]}, first seen at step {tape.step}")
        if left_finite and all(i in left_finite for i in really):
            # finite right after the last update, non-finite now: written outside it
            ev["last_update_step"] = layout.update_step
            ev["detail"] += (f"; the last update (step {layout.update_step}) left them finite, "
                             "so they were written outside optimizer.step() since (an in-place "
                             "edit, a checkpoint load, a bit flip)")
        return ev
    by_order = sorted(calls, key=lambda d: (d["micro_batch"], d["order"]))

    def call_index(d):
        return sum(1 for o in by_order if o["module"] == d["module"]
                   and o["micro_batch"] == d["micro_batch"] and o["order"] < d["order"])

    def name_call(d, phase):
        ev.update(phase=phase, module=module_names[d["module"]],
                  module_type=module_types[d["module"]], call=call_index(d),
                  micro_batch=d["micro_batch"], inputs_finite=d["inputs_finite"], kind=_kind(d))

    def input_event(d, nan_only):
        mb = tape.micro_batches[d["micro_batch"]]
        found = _first_bad_tensor([list(mb.args), mb.kwargs], "", nan_only=nan_only)
        name_call(d, "input")
        if found:
            ev.update(tensor=batch_path(found[0], len(mb.args)), samples=found[1],
                      kind=found[2])
        ev["detail"] = f"non-finite value in the model's input {ev['tensor']}"
        return ev

    # 1. bad data: the root call's inputs (NaN; +-Inf too with strict_inf, see _chain_origin)
    for d in calls:
        if d["module"] == 0 and not d["inputs_finite"]:
            return input_event(d, nan_only=not strict_inf)
    # 2. forward: the first call (in completion order) to make a non-finite output from
    #    finite inputs: a parent's own code counts, a module that passed a NaN on does not.
    if strict_inf:
        bad = [d for d in calls if not d["outputs_finite"]
               and not (d["module"] in allowed and not d["nan"])]
        made = [d for d in bad if d["inputs_finite"]]
        d = (made[0] if made else bad[0]) if bad else None
    else:
        d, came_in = _chain_origin(by_order, allowed, module_names)
        if came_in:
            return input_event(d, nan_only=False)
    if d is not None:
        name_call(d, "forward")
        mb = tape.micro_batches[d["micro_batch"]] if tape.micro_batches else None
        if mb is not None:
            ev["samples"] = _output_samples(mb, d)
        ev["detail"] = (f"{ev['kind']} first in the output of {ev['module'] or '<root>'} "
                        f"({ev['module_type']}), call {ev['call']}")
        return ev
    # 3. loss
    for mb_i, lo, hi in layout.loss:
        if not (math.isfinite(row[lo]) and math.isfinite(row[hi])):
            mb = tape.micro_batches[mb_i]
            outs = list(_tensors(mb.outputs))
            found = _first_bad_tensor([list(mb.loss_args or ()), mb.loss_kwargs or {}], "",
                                      skip=outs)
            kind = ("nan" if math.isnan(row[lo]) or math.isnan(row[hi])
                    else "+inf" if row[hi] == math.inf else "-inf")
            ev.update(micro_batch=mb_i, module="<loss>", kind=kind)
            if found:
                path = loss_path(found[0])
                ev.update(phase="input", tensor=path, samples=found[1], kind=found[2],
                          detail=f"non-finite value in the loss target {path}")
            else:
                ev.update(phase="loss", detail="the loss is non-finite while the model "
                                               "output is finite")
            return ev
    # 4. gradients
    bad_idx = [i for i, k in layout.grads if not math.isfinite(row[k])]
    really = _really_non_finite(bad_idx, param_tensors, grads=True)
    overflowed |= len(really) < len(bad_idx)
    bad_grads = [param_names[i] for i in really]
    if bad_grads:
        ev.update(phase="backward", params=bad_grads,
                  kind=_param_kind(row, layout.grads, param_tensors, grads=True),
                  detail=f"non-finite gradient in {len(bad_grads)} parameter(s), first "
                         f"{bad_grads[0]}")
        return ev
    if overflowed:
        return None  # only norms of huge but finite weights or gradients overflowed
    ev.update(phase="forward", detail="non-finite statistic with no identifiable source")
    return ev


def _chain_origin(by_order: list[dict], allowed: set[int], names: list[str]):
    """The call that started a forward event by the default policy (``strict_inf=False``),
    from decoded calls in completion order, and whether the chain started in the batch (the
    call is then the root call whose inputs held the infinity); (None, False): no forward
    event.

    The event itself is the first NaN made from NaN-free inputs (else the first NaN), or else a
    +-Inf in the root output. Its chain starts at the first call, inside it (completed before
    it), that made a non-finite value from finite inputs; when the event's own inputs held
    +-Inf, at the first call of its micro-batch before it that made +-Inf from finite inputs
    (an fp16 overflow that a later layer turns into NaN), else at the batch's own infinities.
    ``allow_inf`` modules never start a chain: their infinities are intended."""
    nan = [d for d in by_order if d["nan"]]
    made = [d for d in nan if d["inputs_nan_free"]]
    trigger = made[0] if made else (nan[0] if nan else None)
    if trigger is None:
        trigger = next((d for d in by_order if d["module"] == 0 and not d["outputs_finite"]
                        and 0 not in allowed), None)
    if trigger is None:
        return None, False
    mb, pos = trigger["micro_batch"], by_order.index(trigger)
    before = [d for d in by_order[:pos] if d["micro_batch"] == mb
              and not d["outputs_finite"] and d["inputs_all_finite"]
              and d["module"] not in allowed]
    if trigger["inputs_all_finite"]:
        # inside it: calls of its submodules since its previous call completed
        prev = max((i for i, d in enumerate(by_order[:pos]) if d["module"] == trigger["module"]
                    and d["micro_batch"] == mb), default=-1)
        own = names[trigger["module"]]
        inside = [d for d in before if by_order.index(d) > prev
                  and (own == "" or names[d["module"]].startswith(own + "."))]
        return (inside[0] if inside else trigger), False
    infs = [d for d in before if not d["nan"]]
    if infs:
        return infs[0], False
    root = next((d for d in by_order if d["module"] == 0 and d["micro_batch"] == mb
                 and not d["inputs_all_finite"]), None)
    return (root, True) if root is not None else (trigger, False)


def _really_non_finite(indices: list[int], param_tensors, grads: bool) -> list[int]:
    """Those of ``indices`` whose parameter (or gradient) holds a NaN/Inf. The row has their
    squared norms, which overflow float32 for finite values above ~1.8e19; the tensors
    decide (slow path). Without the tensors every index is taken at its word."""
    if param_tensors is None:
        return indices
    out = []
    for i in indices:
        t = param_tensors[i].grad if grads else param_tensors[i]
        if t is None or not bool(torch.isfinite(t.detach()).all()):
            out.append(i)
    return out


def optimizer_event(step: int, params: list[str], *, after_update: bool,
                    kind: str = "nan") -> dict[str, Any]:
    """An update that turned finite weights non-finite. ``after_update``: the bundle holds the
    state after it (caught at the next step), not before (caught by ``guard_optimizer``)."""
    return {"step": step, "reason": "non_finite", "phase": "optimizer", "module": None,
            "module_type": None, "call": None, "micro_batch": None, "inputs_finite": True,
            "kind": kind, "params": params, "tensor": None, "samples": [],
            "after_update": after_update,
            "detail": f"optimizer.step() made {len(params)} parameter(s) non-finite, first "
                      f"{params[0]}"}


def _param_kind(row, pairs, param_tensors=None, grads=False) -> str:
    """"nan", "+inf" or "-inf" of the non-finite parameters (or their gradients). The row only
    holds squared norms, which lose the sign, so the tensors are read when given."""
    bad = [i for i, k in pairs if not math.isfinite(row[k])]
    if any(math.isnan(row[k]) for _, k in pairs):
        return "nan"
    if param_tensors is not None:
        ts = [param_tensors[i].grad if grads else param_tensors[i] for i in bad]
        kind = tensors_kind([t for t in ts if t is not None])
        if kind is not None:
            return kind
    return "inf"


def tensors_kind(tensors) -> str | None:
    """"nan" if any tensor holds a NaN, else "+inf" if any holds +Inf, else "-inf" if any
    holds -Inf; None when all are finite. Slow path only (reads the values)."""
    flags = [(bool(torch.isnan(t).any()), bool(torch.isposinf(t).any()),
              bool(torch.isneginf(t).any())) for t in (t.detach() for t in tensors)
             if t.is_floating_point()]
    for i, kind in enumerate(("nan", "+inf", "-inf")):
        if any(f[i] for f in flags):
            return kind
    return None


def _tensors(obj):
    _, tensors, _ = flatten_tree(obj, "x")
    return tensors.values()


def _output_samples(mb, d) -> list[int]:
    """Batch rows of the root output that are non-finite (the samples the event touched)."""
    return first_bad_rows(_tensors(mb.outputs))


def first_bad_rows(tensors) -> list[int]:
    """The non-finite rows of the first floating tensor that has any; a 0-d one (a loss the
    model computes itself) names no row."""
    for t in tensors:
        if t.is_floating_point() and t.dim():
            rows = bad_rows(t)
            if rows:
                return rows
    return []


def summary(event: dict[str, Any], path: Path | None) -> str:
    """The one-paragraph message of :class:`~recorder.NonFiniteError`."""
    where = ""
    if event.get("module") == "<loss>":
        where = f" Made in the loss of micro-batch {event.get('micro_batch')}."
    elif event.get("module") is not None:
        name = event["module"] or "<root>"
        where = (f" First made by module '{name}' ({event.get('module_type')}, call "
                 f"{event.get('call')}, micro-batch {event.get('micro_batch')})"
                 + (", whose inputs were finite." if event.get("inputs_finite") else ".")
                 + (" It is torch.compile'd: its layers are not recorded one by one."
                    if event.get("compiled") else ""))
    if event.get("tensor"):
        where += f" Tensor {event['tensor']}, samples {event['samples'][:8]}."
    if event.get("params"):
        params = event["params"]
        more = f" (+{len(params) - 4} more)" if len(params) > 4 else ""
        where += f" Parameters: {', '.join(params[:4])}{more}."
    kind = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf", "inf": "Inf", "scale": "AMP scale"}
    when = (f"in an evaluation forward (eval mode, gradients off) before step {event['step']}"
            if event.get("evaluation") else f"at step {event['step']}")
    head = (f"nanreplay: non-finite value ({kind.get(event.get('kind'), event.get('kind'))}) "
            f"{when}, phase {event['phase']}.{where}")
    if path is None:
        return head
    return f"{head} Bundle: {path}; run `nanreplay {path}` to find the op and the cause."
