"""A module call's statistics as refs into the step's slots: an input an earlier call
produced (or a whole view of one) reuses that call's, so a chain of modules costs one
reduction per call; an output is measured once, or moved to the region it is checked in.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from .capture import output_leaves, tensor_leaves
from .compat import version, version_of, view_base
from .finite import ANY, real_view
from .slots import LOOSE, NAN_ONLY, RELU_OF, STRICT, flat_view
from .tape import Tape
from .target import Target


def produced(tape: Tape, t: torch.Tensor, made_here=None) -> tuple | None:
    """The cache entry of the output (or root input) ``t`` is, or is a whole view of, if it is
    unchanged since (or changed in place by the call that returned it)."""
    hit = tape.cache.get(id(t))
    # (a recorded version None: an inference-mode tensor, whose changes are unknown)
    if hit is not None and hit[0]() is t and (
            t is made_here or (hit[4] is not None and hit[4] == version(t))):
        return hit
    # a flatten, view or permutation of an output, covering exactly its elements (ConvNeXt's
    # x.permute(0, 3, 1, 2) back to NCHW: measured again by a sum, large finite values
    # overflowed it, and the call that made the first +-Inf had "non-finite inputs")
    base = view_base(t)
    if base is None:
        return None
    hit = tape.cache.get(id(base))
    if hit is not None and hit[0]() is base and hit[4] is not None \
            and hit[4] == version(base) \
            and t.numel() == base.numel() and t.storage_offset() == base.storage_offset() \
            and dense(t) and dense(base):
        return hit
    return None


def root_input_refs(tape: Tape, target: Target, strict_inf: bool, args, kwargs,
                    versions: list) -> tuple:
    """(min, max, allowed) refs of each floating (or complex: its real view) root input:
    NaN always; +-Inf only with ``strict_inf``, outside ``allow_inf`` (the argument's name,
    ``args[i]`` or a keyword, or an allowed buffer), else an infinity that comes in (a float
    mask) is an event only where it leads. Cached for the first layers that take it;
    ``versions`` gets (input, version). An ``allow_nan`` input is kept, never checked."""
    refs = []
    one = not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor  # the usual batch
    for name, t in (("args[0]", args[0]),) if one else named_leaves(args, kwargs):
        view = None
        if not t.is_floating_point() or t.numel() == 0:
            if not t.is_complex() or t.numel() == 0:
                if t.numel():  # (token ids, masks: not checked, but a reused buffer is seen)
                    versions.append((t, version_of(t)))
                continue
            view = real_view(t)  # (a complex batch, k-space or a spectrum: both parts)
        nan_ok = target.nan_allowed(name)
        hit = produced(tape, t) if tape.cache else None  # (none at a step's start)
        if hit is not None:  # (checked as it was)
            refs.append((hit[1], hit[2], ANY if nan_ok else hit[1][0] % RELU_OF == NAN_ONLY))
            continue
        intended = target.allowed_buffer(t) or target.is_allowed(name)
        soft = not strict_inf or intended
        a, b = tape.slots.minmax(t.detach() if view is None else view,
                                 LOOSE if nan_ok else NAN_ONLY if soft else STRICT)
        refs.append((a, b, ANY if nan_ok else soft))
        # (for the calls that take it, only an allow_inf input's +-Inf is finite)
        version = version_of(t)
        tape.cache[id(t)] = (weakref.ref(t), a, b, intended, version)
        versions.append((t, version))
    return tuple(refs)


def output_ref(tape: Tape, t: torch.Tensor, allowed: bool, intended: bool, reuse: bool
                ) -> tuple:
    """``((min ref, max ref),)`` of one output tensor, or ``()`` if it is not floating.
    ``reuse``: an output passed through unchanged (a Sequential's) keeps the statistics of the
    call that made it, when they sit in the region this call's are checked in."""
    if not t.is_floating_point() or t.numel() == 0:  # (complex, RotatE's r / r.abs(): its real
        return output_ref(tape, real_view(t), allowed, intended, reuse) \
            if t.is_complex() and t.numel() else ()  # view's, for the call that made a NaN)
    code = NAN_ONLY if allowed else STRICT
    hit = tape.cache.get(id(t))
    if reuse and hit is not None and hit[0]() is t and hit[4] is not None \
            and hit[4] == version(t):
        if hit[1][0] % RELU_OF == code and hit[3] == intended:  # (a ReLU of its checked slots)
            return (hit[1:3],)
        # checked as another region is (the root's output, made by an inner call allowed to
        # hold +-Inf): its min and max are moved over, not computed again (an LM's logits)
        a, b = tape.slots.copy_pair(hit[1], hit[2], code)
    else:
        a, b = tape.slots.minmax(t.detach(), code)
    tape.cache[id(t)] = (weakref.ref(t), a, b, intended, version_of(t))
    return ((a, b),)


def input_refs(tape: Tape, target: Target, args, kwargs, made_here=None,
               mask_at: tuple[int, ...] = ()) -> tuple:
    """(min, max, allowed) refs of each floating input of an inner call (kept, never
    checked); an input that an earlier call produced reuses that call's statistics, so a
    chain of modules costs nothing here.

    Inputs are seen after the call: one changed in place since it was produced is
    measured again, unless this call returned it (an in-place module: the produced
    statistics are its input's). ``mask_at``: the positions of the forward's mask
    parameters (:func:`mask_positions`)."""
    refs = []
    masks = mask_inputs(args, kwargs, mask_at) if kwargs or mask_at else ()
    for t in leaves(args, kwargs):
        mask = id(t) in masks
        if not t.is_floating_point() or t.numel() == 0:
            if not (t.is_complex() and t.numel()):
                continue
            t = real_view(t)  # (complex: its real view; float32 refuses a complex sum)
        hit = produced(tape, t, made_here)
        if hit is not None:
            refs.append((hit[1], hit[2], hit[3] or mask))
            continue
        # Only "were they finite" matters for an inner call's inputs: a sum says it in
        # half an aminmax's time (NaN/Inf survive a sum; float32 accumulation)
        ref = tape.slots.total(t.detach(), LOOSE)
        refs.append((ref, ref, mask or target.allowed_buffer(t)))
    return tuple(refs)


def mask_inputs(args, kwargs, positions: tuple[int, ...] = ()) -> set[int]:
    """The ids of the tensors passed as a mask: under a keyword named as one (``attn_mask``,
    ``src_mask``, ``attention_mask``) or at a position of the forward's parameter so named
    (``positions``, :func:`mask_positions`: ``attn(x, mask)``). An additive float mask's -inf
    there is intended, as an ``allow_inf`` input's is (the causal mask
    ``nn.TransformerEncoderLayer`` hands its ``self_attn``), so a call that made a non-finite
    value from it and finite data started a chain (an overflow in the attention's projection)
    instead of passing one on."""
    ids = {id(t) for k, v in kwargs.items() if k.lower().endswith("mask")
           for t in tensor_leaves(v)} if kwargs else set()
    for i in positions:
        if i < len(args):
            ids.update(id(t) for t in tensor_leaves(args[i]))
    return ids


def mask_positions(module: nn.Module) -> tuple[int, ...]:
    """The positions, in a call's ``args``, of the module's ``forward`` parameters named as a
    mask (read once, when its hooks are registered)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # (a builtin's, a C extension's forward)
        return ()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    return tuple(i for i, name in enumerate(positional) if name.lower().endswith("mask"))


def output_refs(tape: Tape, output, allowed: bool, intended: bool, full: bool) -> tuple:
    """((min, max) refs per floating output tensor, (sum, 2-norm, numel) refs of the first
    with ``stats="full"``, ``full``)."""
    outs, stats, inf_ok = [], None, set()  # (a distribution's logits may be -inf)
    for t in (output,) if type(output) is torch.Tensor else output_leaves(output, inf_ok):
        ref = output_ref(tape, t, allowed or id(t) in inf_ok, intended, reuse=not full)
        if ref and full and stats is None:  # sum and 2-norm: far cheaper than std_mean
            d = real_view(t.detach())  # (a complex output: its real view)
            stats = (tape.slots.total(d, LOOSE), tape.slots.norm(d, LOOSE), t.numel())
        outs += ref
    return tuple(outs), stats


def named_leaves(args, kwargs):
    """(top-level name, tensor) of every tensor in a call's arguments: ``args[i]`` or the
    keyword, for tensors nested inside one too."""
    for i, a in enumerate(args):
        for t in tensor_leaves(a):
            yield f"args[{i}]", t
    for k, v in (kwargs or {}).items():
        for t in tensor_leaves(v):
            yield str(k), t


def leaves(args, kwargs):
    for a in args:
        if type(a) is torch.Tensor or isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple, dict)):
            yield from tensor_leaves(a)
    if kwargs:
        yield from tensor_leaves(kwargs)


def dense(t: torch.Tensor) -> bool:
    """Its elements fill one block of memory (contiguous, channels-last, any permutation)."""
    return t.is_contiguous() or flat_view(t, copy=False) is not None
