"""A backward event whose loss took a value the loop made from the model's outputs.

Flip-test averaging in a pose loop, ``out = (model(x) + flip_back(model(x.flip(3)))) / 2``,
hands ``loss_fn`` a tensor that is no model output: the bundle holds its value (the recorder
lists it as ``loss_grad_args``), so the replay re-ran the loss on it as data, found it finite
with no gradient to check, and said the loss "holds terms computed outside it" though the
whole loss was ``loss_fn``'s. An OKS loss over a person of area 0 is finite (``exp(-d² / 0)``
is 0) while its backward is NaN. Here the loss is re-run with such arguments as leaves that
require grad, and backpropagated to them: the first node that made a non-finite gradient
from finite ones is the origin, in the loss, with the rows of that argument's gradient.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch

from recorder.capture import loss_path
from recorder.finite import finite, kind_of

from .backward import saved_facts, saved_tensors
from .findings import finish, origin_fields
from .load import Step, autocast_as_recorded, loss_inputs
from .pole_hints import DIVISOR_OF_DATA, zero_divisor
from .recorded import samples
from .rerun import Runner
from .saved_input import saved_input
from .scalar_pole import SCALAR_POLE, scalar_at_pole
from .source import node_source, node_tracebacks

DERIVED = ("{name}, which the loop made from the model's outputs (flip-test averaging, a "
           "sum of heads, a scaler's inverse_transform) and gave to loss_fn, received a "
           "non-finite gradient from the loss's backward")

RERUN_ON_VALUE = ("the loss was re-run on the value of {name} that the bundle holds and "
                  "backpropagated to it; the loop's code that made it from the model's outputs "
                  "is not re-run")


def derived_arg_report(report, step: Step) -> dict[str, Any] | None:
    """The report of a loss backward origin through a loss argument the loop derived from
    the model's outputs, or None when no such argument's gradient is non-finite."""
    if step.loss_fn is None:
        return None
    for mb, entry in enumerate(step.micro_batches):
        keys = [k for k in entry.get("loss_grad_args") or ()
                if isinstance(t := step.tensors.get(k), torch.Tensor) and t.is_floating_point()
                and finite(t)]
        found = _backward(step, mb, keys, wide=False) if keys else None
        if found is None:
            continue
        node, key, rows, bad = found
        name = loss_path((entry.get("loss_paths") or {}).get(key, key))
        wide = _backward(step, mb, keys, wide=True)
        origin = origin_fields(
            phase="backward", module="<loss>", micro_batch=mb, op=type(node).__name__,
            made=kind_of(bad), samples=rows, tensor=name, source=node_source(node))
        cause, hint = _cause(node, wide is not None)
        if (came := saved_input(step, type(node).__name__, saved_facts(node)[0])) is not None:
            cause, hint = "input", came[1]  # no pole: a NaN target the forward masked
            origin["samples"] = origin["samples"] or came[0]
        report = finish(report, origin, cause, reproduced=True, hint=hint)
        report["problems"].append(DERIVED.format(name=name) + "; " + RERUN_ON_VALUE.format(
            name=name))
        return report
    return None


def _cause(node, in_float64: bool) -> tuple[str, str]:
    name = type(node).__name__
    if not in_float64:
        return "precision", (f"{name} made a non-finite gradient from finite incoming "
                             "gradients, but float64 keeps it finite: a value rounded onto "
                             "its derivative's pole; keep the op's input off the pole with a "
                             "margin the type can hold (a clamp or an eps)")
    if zero_divisor(node) == "data":
        return "invalid", DIVISOR_OF_DATA.format(node=name)
    if scalar_at_pole(node, saved_tensors(node)):  # (a masked RMSE's sqrt, no target)
        return "invalid", SCALAR_POLE.format(node=name)
    return "invalid", (f"{name} made a non-finite gradient from finite incoming gradients, "
                       "in float64 too: its input is at the pole of its derivative (a divisor "
                       "of 0, sqrt or log of 0), which a forward that hides the infinity "
                       "still sends back; make the input safe before the op "
                       "(torch.where(valid, x, 1), an eps) or skip such entries")


def _backward(step: Step, mb: int, keys: list[str], wide: bool):
    """(node, key, rows, grad) of the first loss node that made a non-finite gradient from
    finite ones, backpropagating micro-batch ``mb``'s loss to arguments ``keys`` as leaves;
    None when it made none (or the re-run raised). ``wide``: in float64."""
    dt = torch.float64 if wide else None
    made = {k: step.tensors[k].detach().to(step.device, dt, copy=True).requires_grad_()
            for k in keys}
    view = dataclasses.replace(step, tensors={**step.tensors, **made})
    loss_fn = step.loss_fn
    if wide and isinstance(loss_fn, torch.nn.Module):
        loss_fn = copy.deepcopy(loss_fn).double()
    first: list = []
    try:
        run = Runner(step).run(backward=False, instrument=False)
        outs = [[t.detach().to(dtype=dt) if wide and t.is_floating_point() else t.detach()
                 for t in o] for o in run.outputs]
        args, kwargs = loss_inputs(view, mb, outs, objects=run.objects)
        if wide:
            args, kwargs = _widened((args, kwargs), made)
        cast = contextlib.nullcontext() if wide else autocast_as_recorded(
            step.micro_batches[mb], step.device, loss=True)
        with node_tracebacks(), cast:
            loss = loss_fn(*args, **kwargs)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return None
        handles = [n.register_hook(_watch(n, first)) for n in _nodes(loss.grad_fn)]
        try:
            loss.sum().backward(retain_graph=True)  # (the node's saved divisor, read after)
        finally:
            for h in handles:
                h.remove()
    except Exception:  # (the report without this stands)
        return None
    if not first:
        return None
    key = next((k for k, t in made.items() if t.grad is not None and not finite(t.grad)),
               keys[0])
    grad = made[key].grad
    rows = samples(step, mb).rows(grad) if grad is not None else []
    return first[0], key, rows, first[1]


def _widened(tree, keep: dict[str, torch.Tensor]):
    """Floating tensors of ``tree`` in float64 (the leaves in ``keep`` are already)."""
    ids = {id(t) for t in keep.values()}

    def wide(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() \
            and id(t) not in ids else t
    args, kwargs = tree
    return [wide(a) for a in args], {k: wide(v) for k, v in kwargs.items()}


def _watch(node, first: list):
    def hook(grad_inputs, grad_outputs):
        if first:
            return
        incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
        returned = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
        bad = next((g for g in returned if not finite(g)), None)
        if bad is not None and all(finite(g) for g in incoming):
            first.extend([node, bad.detach()])
    return hook


def _nodes(root) -> list:
    """Every autograd node under ``root``."""
    seen, stack, out = set(), [root], []
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        out.append(n)
        stack.extend(f for f, _ in n.next_functions)
    return out
