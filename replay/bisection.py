"""Finding the first module call with a non-finite output in few runs of one host read each.

:func:`probe` answers whether any call up to completion index ``k`` made a non-finite output;
:func:`search` bisects over ``k`` with it (``ceil(log2 n)`` probes at most); :func:`probe_origin`
then names, for that call, the innermost of it and its enclosing calls whose inputs were
finite. Flags accumulate on the device and are read once, where the answer is known, and the
run stops there (:class:`~replay.errors.StopRun`). ``runner`` is a :class:`replay.rerun.Runner`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from recorder.capture import output_leaves, tensor_leaves
from recorder.finite import ends, pair_flag, real_view
from recorder.refs import mask_inputs, mask_positions
from recorder.running_stats import running_statistics
from recorder.scripted import hookable_modules

from .compat import in_buffers
from .errors import StopRun
from .memo import TensorMemo, TensorSet
from .transforms import outside_transforms


def search(probe: Callable[[int], bool], n_calls: int) -> tuple[int | None, int]:
    """Smallest completion index ``k`` with ``probe(k)`` true, and the number of probes used
    (ceil(log2(n)) at most); ``probe(n_calls - 1)`` is known to be true."""
    lo, hi, probes = 0, n_calls - 1, 0
    if n_calls == 0:
        return None, 0
    while lo < hi:
        mid = (lo + hi) // 2
        probes += 1
        if probe(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, probes


def _ends_memo() -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`ends` of each tensor once per run (on the device, no read)."""
    memo = TensorMemo()

    def of(t: torch.Tensor) -> torch.Tensor:
        e = memo.get(t)
        return e if e is not None else memo.put(t, ends(real_view(t)))
    return of


def probe(runner, k: int, allowed: set[str]) -> bool:
    """One fresh run, one host read: has any call up to completion index ``k`` made a
    non-finite output (+-Inf fine in the modules ``allowed``)?"""
    state: dict[str, Any] = {"i": 0, "flag": None, "answer": None}
    ends_of = _ends_memo()

    def hooks(model):
        hs = []
        for name, m in hookable_modules(model):
            def post(module, args, output, name=name):
                i = state["i"]
                state["i"] += 1
                inf_ok: set[int] = set()
                for t in output_leaves(output, inf_ok):
                    if (t.is_floating_point() or t.is_complex()) and t.numel():
                        bad = ~pair_flag(ends_of(t), allow_inf=name in allowed or id(t) in inf_ok)
                        state["flag"] = bad if state["flag"] is None else state["flag"] | bad
                for b in running_statistics(module):  # (state it wrote: recorder.running_stats)
                    bad = ~pair_flag(ends(b))
                    state["flag"] = bad if state["flag"] is None else state["flag"] | bad
                if i == k:
                    flag = state["flag"]
                    state["answer"] = bool(flag) if flag is not None else False
                    raise StopRun
            hs.append(m.register_forward_hook(outside_transforms(post)))
        return hs

    runner.run(backward=False, instrument=False, hooks=hooks)
    return bool(state["answer"])


def probe_origin(runner, k: int, nan_only: bool = False) -> tuple[str, int, int] | None:
    """One fresh run, one host read: for the call at completion index ``k`` (the first
    non-finite output), whether its inputs and those of each enclosing call were finite.
    The innermost of them with finite inputs made the value: ``(module, call, micro-batch)``.
    ``nan_only``: NaN-free inputs count as finite (the origin made a NaN).
    """
    state: dict[str, Any] = {"i": 0, "stack": [], "starts": {}, "answer": None}
    produced_allowed = TensorSet()  # outputs of allow_inf modules: -inf is fine
    ends_of = _ends_memo()
    mask_at: dict[str, tuple[int, ...]] = {}  # module -> its forward's mask positions

    def input_ok(t: torch.Tensor, masks) -> torch.Tensor:
        soft = nan_only or id(t) in masks or in_buffers(t, runner.allowed_buffers) \
            or t in produced_allowed
        return pair_flag(ends_of(t), allow_inf=soft)

    def pre(module, args, kwargs, name):
        key = (name, runner.micro_batch)
        call = state["starts"].get(key, 0)
        state["starts"][key] = call + 1
        masks = mask_inputs(args, kwargs, mask_at[name]) if name else ()  # (root's: recorded)
        flags = [input_ok(t, masks) for t in tensor_leaves([list(args), kwargs])
                 if (t.is_floating_point() or t.is_complex()) and t.numel()]
        ok = torch.stack(flags).all() if flags else torch.tensor(True)
        state["stack"].append((name, call, runner.micro_batch, ok))

    def post(module, args, kwargs, output, name):
        i = state["i"]
        state["i"] += 1
        frame = state["stack"].pop()
        if name in runner.allowed:
            for t in tensor_leaves(output):
                produced_allowed.add(t)
        if i == k:
            chain = state["stack"] + [frame]
            oks = torch.stack([f[3] for f in chain]).tolist()  # the one read
            for (mod, call, mb, _), ok in reversed(list(zip(chain, oks))):
                if ok:
                    state["answer"] = (mod, call, mb)
                    break
            raise StopRun

    def hooks(model):
        hs = []
        for name, m in hookable_modules(model):
            mask_at[name] = mask_positions(m)
            hs.append(m.register_forward_pre_hook(outside_transforms(
                lambda mod, a, kw, name=name: pre(mod, a, kw, name)), with_kwargs=True))
            hs.append(m.register_forward_hook(outside_transforms(
                lambda mod, a, kw, out, name=name: post(mod, a, kw, out, name)),
                with_kwargs=True))
        return hs

    runner.run(backward=False, instrument=False, hooks=hooks)
    return state["answer"]
