"""Gradient (and, with ``stats="full"``, weight) norms taken when no hook fires for them: right
before the update, for the parameters whose gradients no backward hook measured or that changed
since, and for the many small parameters, batched into foreach calls when the row is built.
Under FSDP2 the norms are of the rank's local shards (:func:`recorder.shards.local`): a
DTensor's own norm would be a collective.
"""

from __future__ import annotations

import operator

import torch

from .compat import scaler_unscaled, version
from .finite import checkable, stored
from .shards import PLAIN, local
from .slots import GRAD, STRICT
from .tape import Tape
from .target import Target

_GRAD, _LAYOUT = operator.attrgetter("grad"), operator.attrgetter("layout")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PLAIN, _STRIDED = frozenset((torch.Tensor,)), frozenset((torch.strided,))
_DENSE = torch.strided


def small_param_norms(tape: Tape, target: Target, param_norms: bool) -> None:
    """Squared norms of the small parameters' gradients (and weights), two foreach calls. A
    CNN or a transformer has dozens (norm layers, biases): the usual case, every gradient a
    plain, dense, non-empty floating tensor no hook measured, is told by C loops over them,
    with no Python per parameter."""
    grads = list(map(_GRAD, target.small_params))
    if (_PLAIN.issuperset(map(type, grads)) and _STRIDED.issuperset(map(_LAYOUT, grads))
            and all(map(torch.Tensor.is_floating_point, grads))
            and all(map(torch.Tensor.numel, grads)) and not any(map(_REQUIRES_GRAD, grads))
            and tape.grad_norms.keys().isdisjoint(target.small)):
        with tape.lock:
            tape.grad_norms.update(zip(target.small, tape.slots.sq_norms(grads, GRAD)))
            if param_norms:
                tape.param_norms.update(zip(target.small, tape.slots.sq_norms(
                    [local(p).detach() for p in target.small_params], STRICT)))
        return
    params = target.params
    idx = [i for i in target.small if i not in tape.grad_norms
           and params[i][1].grad is not None and checkable(params[i][1].grad)]
    if not idx:
        return
    tensors = [params[i][1] for i in idx]
    with tape.lock:
        tape.grad_norms.update(zip(idx, tape.slots.sq_norms(
            [stored(local(p.grad)).detach() for p in tensors], GRAD)))
        if param_norms:
            tape.param_norms.update(zip(idx, tape.slots.sq_norms(
                [local(p).detach() for p in tensors], STRICT)))


def output_grad_norms(tape: Tape) -> None:
    """Squared norms of the gradients backward brought to the root outputs, which the
    micro-batches keep for the replay: taken when the step closes, in one loop, and checked
    with the parameters' gradients (a loss computed where the recorder cannot see it shows
    here even when the model's backward drops its non-finite entries)."""
    mbs = tape.micro_batches
    if len(mbs) == 1 and len(out_grads := mbs[0].out_grads) == 1:  # one forward, one output
        (i, g), = out_grads.items()
        if type(g) is torch.Tensor and g.layout is _DENSE and not g.requires_grad \
                and g.numel() and (ref := tape.slots.sq_norm_dense(g, GRAD)) is not None:
            tape.out_grad_norms = [(0, i, ref)]
            return
    where, grads = [], []
    for k, mb in enumerate(mbs):
        if not mb.out_grads:
            continue
        for i, g in list(mb.out_grads.items()):
            if type(g) not in PLAIN:
                g = local(g)
            if g.layout is not torch.strided:
                if not checkable(g):
                    continue
                g = stored(g)
            elif not (g.is_floating_point() or g.is_complex()) or not g.numel():
                continue
            where.append((k, i))
            grads.append(g.detach() if g.requires_grad else g)
    if grads:
        refs = tape.slots.sq_norm_each(grads, GRAD)
        tape.out_grad_norms = [(k, i, ref) for (k, i), ref in zip(where, refs)]


def reread_changed_grads(tape: Tape, target: Target, param_norms: bool) -> None:
    """Norms of the gradients the optimizer will use. With backward hooks, only those that
    changed since backward wrote them: DDP's all-reduced average, GradScaler's unscaled
    values, clipping, a replaced tensor. Small parameters: see :func:`small_param_norms`."""
    every = not target.grad_hooks or target.ddp or target.has_scaler
    if every and not param_norms:  # the usual case: plain dense gradients, told by C loops
        idx, params = target.large_last_first
        grads = list(map(_GRAD, params))
        if grads and _PLAIN.issuperset(map(type, grads)) \
                and _STRIDED.issuperset(map(_LAYOUT, grads)) and not any(map(_REQUIRES_GRAD, grads)):
            with tape.lock:
                tape.grad_norms.update(zip(idx, tape.slots.sq_norm_each(grads, GRAD)))
                tape.grads_reread = _unscaled(target)
            return
    seen = tape.grad_seen
    strided = torch.strided
    idx, grads = [], []
    # last parameter first: the optimizer starts with the first, whose gradient is then
    # the one still in cache
    for i, p in reversed(target.large):
        grad = p.grad
        if grad is None:
            continue
        if grad.layout is not strided:  # a sparse one (nn.Embedding(sparse=True)): its values
            if not checkable(grad):
                continue
            grad = stored(grad)
        if every or seen.get(i) != (id(grad), version(grad)):
            idx.append(i)
            if type(grad) not in PLAIN:  # (``local`` inlined: this runs for every gradient)
                grad = local(grad)
            grads.append(grad.detach() if grad.requires_grad else grad)
    if not idx:
        if every:  # (no large gradient: the small ones' norms, taken after this, are as read)
            tape.grads_reread = _unscaled(target)
        return
    with tape.lock:
        tape.grad_norms.update(zip(idx, tape.slots.sq_norm_each(grads, GRAD)))
        tape.grads_reread = _unscaled(target)
        if param_norms and not target.grad_hooks:
            weights = [local(target.params[i][1]).detach() for i in idx]
            tape.param_norms.update(zip(idx, tape.slots.sq_norm_each(weights, STRICT)))


def _unscaled(target: Target) -> bool:
    """Gradients read now hold what the update takes: no GradScaler, or it unscaled them
    (else the step's norms are divided by its scale: see ``Tape.grads_reread``)."""
    return not target.has_scaler or scaler_unscaled(target.scaler(), target.optimizer())


def first_weight_norms(tape: Tape, target: Target) -> None:
    """Squared norms of the weights no statistic measured yet, in the steps before the
    recorded optimizer's first update only (``tape.finite_at_open`` is set then, usually one
    step): a weight the run started with non-finite (a CRF's forbidden transitions written
    as -inf into a trained parameter, a corrupt checkpoint) is a ``weights`` event of the
    step that used it, not one the first update seems to have made."""
    if tape.finite_at_open is None:
        return
    # (the weights the update evidence measures after each update: the optimizer's)
    held = [(i, p) for i, p in (*target.update_large, *target.update_small)
            if i not in tape.param_norms and checkable(local(p))]
    if held:
        tape.slots.once = True
        with tape.lock:
            tape.param_norms.update(zip([i for i, _ in held], tape.slots.sq_norm_each(
                [local(p).detach() for _, p in held], STRICT)))


def unowned_weight_norms(tape: Tape, target: Target) -> None:
    """Squared norms of the trained weights the recorded optimizer does not hold (none, the
    usual case), every step: another optimizer updates them (DreamerV3's actor and critic
    beside the world model's Adam), which leaves no update evidence here, and a forward that
    never reads them (the world model's) would show their NaN only once a later gradient goes
    bad, steps after, mixed with what it broke since (the critic's eps=0 update at step 0, seen
    at step 2 with the actor's and the EMA target's)."""
    held = [(i, p) for i, p in target.unowned if i not in tape.param_norms and checkable(local(p))]
    if held:
        with tape.lock:
            tape.param_norms.update(zip([i for i, _ in held], tape.slots.sq_norm_each(
                [local(p).detach() for _, p in held], STRICT)))


def weight_step_norms(tape: Tape, target: Target, param_norms: bool) -> None:
    """The norms taken as a training step's row is built: the small parameters', then the
    weights' before the first update, and those of the weights another optimizer updates;
    and the running statistics' extremes (recorder.running_stats)."""
    if target.small:
        small_param_norms(tape, target, param_norms)
    first_weight_norms(tape, target)
    if target.unowned:
        unowned_weight_norms(tape, target)
    target.running_stats.measure(tape.slots)  # (BatchNorm's; none without such layers)
