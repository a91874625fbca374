"""Re-running the recorded step, deterministically, as often as the analysis needs.

Every run starts from the same state: RNG states from the bundle, buffers as recorded,
gradients cleared. A run is forward (each micro-batch), loss, backward; optional hooks watch it.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from recorder.capture import map_tensors, restore_rng, tensor_leaves

from .load import (
    Step,
    autocast_as_recorded,
    loss_inputs,
    micro_batch_inputs,
    output_grads,
    rng_state,
)
from .ops import raised_by_model


class StopRun(Exception):
    """Raised from a hook to end a probe run early (its answer is known)."""


def ends(t: torch.Tensor) -> torch.Tensor:
    """(min, max) of a floating tensor as a float64 pair, on its device: NaN propagates, so
    the pair says whether ``t`` holds NaN or +-Inf too. One reduction pass, where
    ``isfinite(t).all()`` takes a full-size temporary and, on CPU, several times longer."""
    return torch.stack(torch.aminmax(t.detach())).double()


class _Ends:
    """:func:`ends` of the tensors one run has seen, by identity and version: an output that a
    parent passes on from its child, or that the next call takes as input, is reduced once (a
    tensor modified in place since is reduced again)."""

    def __init__(self):
        self._seen: dict[int, tuple] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        e = ends(t)
        self._seen[id(t)] = (weakref.ref(t), t._version, e)
        return e


def _flag(e: torch.Tensor, allow_inf: bool) -> torch.Tensor:
    """Finite (NaN-free, with ``allow_inf``) from an :func:`ends` pair, on the device."""
    return ~torch.isnan(e).any() if allow_inf else torch.isfinite(e).all()


def pair_ok(lo: float, hi: float, allow_inf: bool = False) -> bool:
    if allow_inf:
        return not (math.isnan(lo) or math.isnan(hi))
    return math.isfinite(lo) and math.isfinite(hi)


def finite_flag(t: torch.Tensor, allow_inf: bool = False) -> torch.Tensor:
    """:func:`finite` as a 0-d bool tensor on ``t``'s device (no host read)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if t.is_complex():
        flags = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
        return ~flags.any()
    return _flag(ends(t), allow_inf)


def finite(t: torch.Tensor, allow_inf: bool = False) -> bool:
    """No NaN/Inf in ``t`` (no NaN only, with ``allow_inf``); True for non-floating tensors."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    return bool(finite_flag(t, allow_inf))


def kind_of(t: torch.Tensor) -> str | None:
    """'nan', '+inf' or '-inf' for the first kind of non-finite value present (NaN first)."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    return _pair_kind(*ends(t).tolist())


def _pair_kind(lo: float, hi: float) -> str | None:
    """:func:`kind_of` from (min, max): NaN propagates through both; else they show +-Inf."""
    if math.isnan(lo) or math.isnan(hi):
        return "nan"
    if hi == math.inf:
        return "+inf"
    if lo == -math.inf:
        return "-inf"
    return None


@dataclass
class Call:
    """One module call of a run, in completion order."""

    index: int  # completion order across the step
    module: str
    call: int  # k-th call of this module in its micro-batch
    micro_batch: int
    inputs_finite: bool
    outputs_finite: bool
    kind: str | None
    minmax: tuple  # exact (min, max) of each output, as strings, to compare runs
    parents: tuple[int, ...] = ()  # module-call ids enclosing it (outermost first)
    call_id: int = 0  # start order, for parent links
    bad_rows: list[int] = field(default_factory=list)
    nan: bool = False  # an output holds NaN
    inputs_all_finite: bool = True  # no NaN/+-Inf in its inputs, allowed or not
    inputs_nan_free: bool = True


@dataclass
class Run:
    calls: list[Call] = field(default_factory=list)
    loss_finite: list[bool] = field(default_factory=list)
    loss_values: list[str] = field(default_factory=list)
    bad_grads: list[str] = field(default_factory=list)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    error: Exception | None = None  # what the model's own code raised, ending the run there
    strict_inf: bool = True  # the recording's policy (see FlightRecorder's strict_inf)
    allowed: frozenset = frozenset()  # modules allowed to hold +-Inf (allow_inf)

    @property
    def raised(self) -> str | None:
        """``error`` in one line (``"RuntimeError: ..."``), or None."""
        e = self.error
        return None if e is None else " ".join(f"{type(e).__name__}: {e}".split())

    def forward_origin(self) -> Call | None:
        """First call (completion order) to make a non-finite output from finite inputs; by
        the default policy, where the chain of the forward event starts (:meth:`chain`)."""
        if not self.strict_inf:
            return self.chain()[0]
        bad = [c for c in self.calls if not c.outputs_finite]
        made = [c for c in bad if c.inputs_finite]
        return made[0] if made else (bad[0] if bad else None)

    def chain(self) -> tuple[Call | None, Call | None, bool]:
        """By the default policy (``strict_inf=False``, as ``recorder.events`` decides): the
        call where the forward event's chain starts, the event's call (the first NaN made from
        NaN-free inputs, else a +-Inf in the root output), and whether the chain started in
        the batch (+-Inf that came in; the first call is then the root's). Nones: no event."""
        calls, allowed = self.calls, self.allowed
        nan = [c for c in calls if c.nan]
        made = [c for c in nan if c.inputs_nan_free]
        trigger = made[0] if made else (nan[0] if nan else None)
        if trigger is None:
            trigger = next((c for c in calls if c.module == "" and not c.outputs_finite
                            and "" not in allowed), None)
        if trigger is None:
            return None, None, False
        before = [c for c in calls[:calls.index(trigger)]
                  if c.micro_batch == trigger.micro_batch and not c.outputs_finite
                  and c.inputs_all_finite and c.module not in allowed]
        if trigger.inputs_all_finite:  # made inside it: by it, or by a call it encloses
            inside = [c for c in before if trigger.call_id in c.parents]
            return (inside[0] if inside else trigger), trigger, False
        infs = [c for c in before if not c.nan]
        if infs:  # it consumed an infinity made earlier (an overflow)
            return infs[0], trigger, False
        root = next((c for c in calls if c.module == "" and c.micro_batch == trigger.micro_batch
                     and not c.inputs_all_finite), None)
        return (root or trigger), trigger, root is not None

    def signature(self) -> tuple:
        """What two runs of a deterministic step must agree on, bit for bit."""
        return (tuple((c.module, c.call, c.micro_batch, c.minmax) for c in self.calls),
                tuple(self.loss_values), tuple(self.bad_grads), self.raised)


class Runner:
    """Runs the step of a rebuilt bundle; see :meth:`run`."""

    def __init__(self, step: Step):
        self.step = step
        self.model: nn.Module = step.model
        patterns = step.meta.get("allow_inf", [])
        names = list(dict(self.model.named_modules()))
        self.allowed = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        self.allowed_buffers = {id(b) for n, b in self.model.named_buffers()
                                if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        self._buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self._rng = rng_state(step)
        # bundles from before the default policy were recorded with every +-Inf an event
        self.strict_inf = bool(step.meta.get("strict_inf", True))
        self.cast: torch.dtype | None = None  # run in this dtype (the float64 re-run)
        # gradients fed into the model outputs instead of the recorded ones, finite or not
        # (micro-batch -> output index -> gradient): see replay.outside
        self.out_grads: dict[int, dict[int, torch.Tensor]] | None = None
        # multiply the loss by this before backward, as the step's GradScaler did (only where
        # no finite recorded output gradient, which holds the scale already, is used)
        self.loss_scale: float | None = None
        self.last_loss = None

    # -- state reset -------------------------------------------------------------------------

    def reset(self) -> None:
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                if n in self._buffers:
                    b.copy_(self._buffers[n])
        self.model.zero_grad(set_to_none=True)
        if self._rng is not None:
            restore_rng(self._rng)

    # -- one run -----------------------------------------------------------------------------

    def run(self, *, backward: bool = True, instrument: bool = True, hooks=None,
            forward_ctx=None, backward_ctx=None, loss_scale: float | None = None) -> Run:
        """Forward every micro-batch, the loss, and (``backward``) the backward pass.

        ``instrument`` records every module call (with syncs: this is the replay, not the
        recorder). ``hooks(model)`` may install extra hooks and must return their handles.
        """
        self.reset()
        if loss_scale is None:
            loss_scale = self.loss_scale
        result = Run(strict_inf=self.strict_inf, allowed=frozenset(self.allowed))
        handles = self._instrument(result) if instrument else []
        if hooks is not None:
            handles += hooks(self.model)
        try:
            for i, mb in enumerate(self.step.micro_batches):
                self._mb = i
                args, kwargs = micro_batch_inputs(self.step, i)
                if self.cast is not None:
                    args, kwargs = _cast((args, kwargs), self.cast)
                with torch.set_grad_enabled(mb.get("grad_enabled", True)), \
                        (autocast_as_recorded(mb, self.step.device) if self.cast is None
                         else _null()), \
                        (forward_ctx() if forward_ctx else _null()):
                    out = self.model(*args, **kwargs)
                outs = list(tensor_leaves(out))
                result.outputs.append(outs)
                with forward_ctx() if forward_ctx else _null():  # the loss's nodes too
                    loss = self._loss(i, outs, result)
                if backward and mb.get("grad_enabled", True):
                    with backward_ctx() if backward_ctx else _null():
                        self._backward(i, outs, loss, loss_scale)
        except StopRun:
            pass
        except Exception as e:  # the model's code raising (an assert on NaN, an op refusing
            if not raised_by_model(e):  # NaN input) ends the run as it ended the step
                raise
            result.error = e
        finally:
            for h in handles:
                h.remove()
        if backward:
            result.bad_grads = [n for n, p in self.model.named_parameters()
                                if p.grad is not None and not finite(p.grad)]
        return result

    def _loss(self, i: int, outs: list[torch.Tensor], result: Run):
        if self.step.loss_fn is None:
            return None
        li = loss_inputs(self.step, i, outs)
        if li is None:
            return None
        args, kwargs = li
        if self.cast is not None:
            args, kwargs = _cast((args, kwargs), self.cast)
            loss = self.step.loss_fn(*args, **kwargs)
        else:
            with autocast_as_recorded(self.step.micro_batches[i], self.step.device):
                loss = self.step.loss_fn(*args, **kwargs)
        self.last_loss = loss
        vals = [t for t in tensor_leaves(loss) if t.is_floating_point()]
        result.losses.append(loss)
        result.loss_finite.append(all(finite(t) for t in vals))
        result.loss_values.append(";".join(repr(t.detach().double().sum().item()) for t in vals))
        return loss

    def _backward(self, i: int, outs, loss, loss_scale) -> None:
        fed = self.out_grads is not None
        grads = self.out_grads.get(i, {}) if fed else output_grads(self.step, i)
        pairs = [(o, grads[j]) for j, o in enumerate(outs) if j in grads and o.requires_grad]
        if pairs and (fed or all(finite(g) for _, g in pairs)):
            # The recorded gradient of the model output is exact whatever the loop did to the
            # loss (scaling, division for accumulation); prefer it.
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        elif isinstance(loss, torch.Tensor) and loss.requires_grad:
            (loss * loss_scale if loss_scale else loss).backward()

    # -- instrumentation -----------------------------------------------------------------------

    def _instrument(self, result: Run) -> list:
        handles = []
        stack: list[int] = []
        counts: dict[tuple[str, int], int] = {}
        produced_allowed: dict[int, Any] = {}
        # outputs already checked: id -> (weakref, version, (min, max)); an input that an
        # earlier call made costs nothing unless it was modified in place since
        checked: dict[int, tuple] = {}
        starts = [0]
        pending: dict[int, tuple] = {}

        def known(t: torch.Tensor) -> tuple[float, float] | None:
            hit = checked.get(id(t))
            if hit is not None and hit[0]() is t and hit[1] == t._version:
                return hit[2]
            return None

        def inputs_ok(args, kwargs) -> tuple[bool, bool, bool]:
            """Finite (allow_inf honoured), finite (every +-Inf counted), NaN-free."""
            ok = every = nan_free = True
            for t in tensor_leaves([list(args), kwargs]):
                if not t.is_floating_point() or t.numel() == 0:
                    if t.is_complex() and not finite(t):
                        ok = every = False
                        nan_free = nan_free and not bool(torch.isnan(t).any())
                    continue
                soft = id(t) in self.allowed_buffers or (
                    id(t) in produced_allowed and produced_allowed[id(t)]() is t)
                pair = known(t)
                if pair is None:
                    pair = tuple(ends(t).tolist())
                    checked[id(t)] = (weakref.ref(t), t._version, pair)
                ok = ok and pair_ok(*pair, allow_inf=soft)
                every = every and pair_ok(*pair)
                nan_free = nan_free and pair_ok(*pair, allow_inf=True)
            return ok, every, nan_free

        def pre(name):
            def hook(module, args, kwargs):
                call_id = starts[0]
                starts[0] += 1
                pending[call_id] = (inputs_ok(args, kwargs), tuple(stack))
                stack.append(call_id)
            return hook

        def post(name):
            def hook(module, args, kwargs, output):
                if not stack:
                    return
                call_id = stack.pop()
                (ok_in, every_in, nan_free_in), parents = pending.pop(call_id)
                outs = [t for t in tensor_leaves(output) if t.is_floating_point() and t.numel()]
                allowed = name in self.allowed
                pairs = [known(t) for t in outs]
                todo = [i for i, p in enumerate(pairs) if p is None]
                if todo:
                    fresh = torch.stack([ends(outs[i]) for i in todo]).tolist()
                    for i, pair in zip(todo, fresh):
                        pairs[i] = tuple(pair)
                ok_out = all(pair_ok(lo, hi, allow_inf=allowed) for lo, hi in pairs)
                kind = next((_pair_kind(lo, hi) for lo, hi in pairs if not pair_ok(lo, hi)),
                            None)
                for t, pair in zip(outs, pairs):
                    checked[id(t)] = (weakref.ref(t), t._version, pair)
                    if allowed:
                        produced_allowed[id(t)] = weakref.ref(t)
                mm = tuple(tuple(repr(v) for v in pair) for pair in pairs)
                key = (name, self._mb)
                k = counts.get(key, 0)
                counts[key] = k + 1
                rows = _output_rows(outs) if not ok_out else []
                nan = any(math.isnan(lo) or math.isnan(hi) for lo, hi in pairs)
                result.calls.append(Call(len(result.calls), name, k, self._mb, ok_in, ok_out,
                                         kind, mm, parents, call_id, rows, nan, every_in,
                                         nan_free_in))
            return hook

        for name, m in self.model.named_modules():
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name), with_kwargs=True))
        return handles

    # -- bisection -----------------------------------------------------------------------------

    def probe(self, k: int, allowed: set[str]) -> bool:
        """One fresh run, one host read: has any call up to completion index ``k`` made a
        non-finite output? Flags accumulate on the device; the read happens at call ``k``."""
        state: dict[str, Any] = {"i": 0, "flag": None, "answer": None}
        seen = _Ends()

        def hooks(model):
            hs = []
            for name, m in model.named_modules():
                def post(module, args, output, name=name):
                    i = state["i"]
                    state["i"] += 1
                    for t in tensor_leaves(output):
                        if t.is_floating_point() and t.numel():
                            bad = ~_flag(seen(t), allow_inf=name in allowed)
                            state["flag"] = bad if state["flag"] is None else state["flag"] | bad
                    if i == k:
                        flag = state["flag"]
                        state["answer"] = bool(flag) if flag is not None else False
                        raise StopRun
                hs.append(m.register_forward_hook(post))
            return hs

        self.run(backward=False, instrument=False, hooks=hooks)
        return bool(state["answer"])

    def probe_origin(self, k: int, nan_only: bool = False) -> tuple[str, int, int] | None:
        """One fresh run, one host read: for the call at completion index ``k`` (the first
        non-finite output), whether its inputs and those of each enclosing call were finite.
        The innermost of them with finite inputs made the value: ``(module, call, micro-batch)``.
        ``nan_only``: NaN-free inputs count as finite (the origin made a NaN).
        """
        state: dict[str, Any] = {"i": 0, "stack": [], "starts": {}, "answer": None}
        produced_allowed: dict[int, Any] = {}  # outputs of allow_inf modules: -inf is fine
        seen = _Ends()

        def input_ok(t: torch.Tensor) -> torch.Tensor:
            soft = nan_only or id(t) in self.allowed_buffers or (
                id(t) in produced_allowed and produced_allowed[id(t)]() is t)
            return _flag(seen(t), allow_inf=soft)

        def hooks(model):
            hs = []
            for name, m in model.named_modules():
                def pre(module, args, kwargs, name=name):
                    key = (name, self._mb)
                    call = state["starts"].get(key, 0)
                    state["starts"][key] = call + 1
                    flags = [input_ok(t) for t in tensor_leaves([list(args), kwargs])
                             if t.is_floating_point() and t.numel()]
                    ok = torch.stack(flags).all() if flags else torch.tensor(True)
                    state["stack"].append((name, call, self._mb, ok))

                def post(module, args, kwargs, output, name=name):
                    i = state["i"]
                    state["i"] += 1
                    frame = state["stack"].pop()
                    if name in self.allowed:
                        for t in tensor_leaves(output):
                            produced_allowed[id(t)] = weakref.ref(t)
                    if i == k:
                        chain = state["stack"] + [frame]
                        oks = torch.stack([f[3] for f in chain]).tolist()  # the one read
                        for (mod, call, mb, _), ok in reversed(list(zip(chain, oks))):
                            if ok:
                                state["answer"] = (mod, call, mb)
                                break
                        raise StopRun
                hs.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                hs.append(m.register_forward_hook(post, with_kwargs=True))
            return hs

        self.run(backward=False, instrument=False, hooks=hooks)
        return state["answer"]

    def bisect(self, n_calls: int, nan_only: bool = False) -> tuple[int | None, int]:
        """Smallest completion index whose prefix holds a non-finite output (a NaN, with
        ``nan_only``), and the number of probes used (ceil(log2(n)) at most). The caller knows
        some output is non-finite."""
        allowed = set(dict(self.model.named_modules())) if nan_only else self.allowed
        lo, hi, probes = 0, n_calls - 1, 0
        if n_calls == 0:
            return None, 0
        while lo < hi:
            mid = (lo + hi) // 2
            probes += 1
            if self.probe(mid, allowed):
                hi = mid
            else:
                lo = mid + 1
        return lo, probes


def _cast(obj, dtype):
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _output_rows(outs: list[torch.Tensor]) -> list[int]:
    """The non-finite rows of a call's first batched non-finite output: a 0-d one (a loss
    computed in the model) names no row, unless the call returned nothing else."""
    batched = [t for t in outs if t.dim()]
    if not batched:
        return _bad_rows(outs[0]) if outs else []
    return next((_bad_rows(t) for t in batched if not finite(t)), [])


def _bad_rows(t: torch.Tensor) -> list[int]:
    """Indices along dim 0 holding a non-finite value: one min/max pass per row."""
    if t.dim() == 0:
        return [] if finite(t) else [0]
    if t.numel() == 0:
        return []
    lo, hi = torch.aminmax(t.detach().reshape(t.shape[0], -1), dim=1)
    return (~(torch.isfinite(lo) & torch.isfinite(hi))).nonzero().flatten().tolist()
