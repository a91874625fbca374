"""The instrumented pass: hooks on every module that record each call of a re-run as a
:class:`~replay.run_result.Call` (inputs finite, outputs finite, exact (min, max), rows).

This is the replay, not the recorder: every call reads its values on the host. A tensor that
an earlier call made (the next call's input, an output a parent passes on) is reduced once,
unless it was modified in place since (:class:`~replay.memo.TensorMemo`).
"""

from __future__ import annotations

import inspect
import math

import torch

from recorder.capture import output_leaves, tensor_leaves  # not pytree: see replay.rerun
from recorder.compat import version_of
from recorder.finite import ends, finite, has_nan, pair_kind, pair_ok, real_view
from recorder.refs import mask_inputs, mask_positions
from recorder.running_stats import statistics_finite, statistics_kind
from recorder.samples import Samples, packed_in
from recorder.scripted import hookable_modules

from .bits import as_integers
from .compat import in_buffers, running_node
from .input_container import IN_PLACE
from .memo import TensorMemo, TensorSet
from .recorded import samples
from .run_result import Call, Run
from .source import caller_source
from .transforms import outside_transforms


class CallRecorder:
    """Appends one :class:`Call` per module call to ``result``; ``runner`` says which modules
    and buffers may hold +-Inf (``allowed``, ``allowed_buffers``) and which micro-batch runs
    (``micro_batch``)."""

    def __init__(self, runner, result: Run):
        self.runner, self.result = runner, result
        self.stack: list[int] = []  # call ids of the calls running, outermost first
        self.counts: dict[tuple[str, int], int] = {}  # (module, micro-batch) -> calls so far
        self.pending: dict[int, tuple] = {}  # call id -> (input flags, enclosing call ids)
        self.started = 0
        self.called_at: dict[int, str | None] = {}  # call id -> the user's line that called it
        self.produced_allowed = TensorSet()  # outputs of modules allowed to hold +-Inf
        self.checked = TensorMemo()  # tensor -> its (min, max) on the host
        self.weights: set[int] = set()  # ids of the model's parameters and buffers
        # call id -> a normalization layer's running statistics were finite as it began
        self.stats_before: dict[int, bool] = {}
        self.versions: dict[int, list] = {}  # call id -> its input tensors' versions as it began

    def install(self, model) -> list:
        self.weights = {id(t) for t in [*model.parameters(), *model.buffers()]}
        handles = []
        for name, m in hookable_modules(model):
            at = mask_positions(m) if name else ()  # (the root's masks: as recorded)
            handles.append(m.register_forward_pre_hook(outside_transforms(self._pre(name, at)),
                                                       with_kwargs=True))
            handles.append(m.register_forward_hook(outside_transforms(self._post(name)),
                                                   with_kwargs=True))
        return handles

    def _pair(self, t: torch.Tensor) -> tuple[float, float]:
        pair = self.checked.get(t)
        return pair if pair is not None else self.checked.put(t, tuple(ends(t).tolist()))

    def _inputs_ok(self, args, kwargs, root: bool, mask_at: tuple[int, ...]
                   ) -> tuple[bool, bool, bool]:
        """Finite (allow_inf honoured), finite (every +-Inf counted), NaN-free."""
        ok = every = nan_free = True
        masks = mask_inputs(args, kwargs, mask_at) if not root else ()  # (root's: recorded)
        for t in tensor_leaves([list(args), kwargs]):
            if not t.is_floating_point() or t.numel() == 0:
                if t.is_complex() and not finite(t):
                    ok = every = False
                    nan_free = nan_free and not has_nan(t)
                continue
            soft = id(t) in masks or in_buffers(t, self.runner.allowed_buffers) \
                or t in self.produced_allowed
            pair = self._pair(t)
            ok = ok and pair_ok(*pair, allow_inf=soft)
            every = every and pair_ok(*pair)
            nan_free = nan_free and pair_ok(*pair, allow_inf=True)
        return ok, every, nan_free

    def _pre(self, name: str, mask_at: tuple[int, ...]):
        def hook(module, args, kwargs):
            call_id = self.started
            self.started += 1
            self.pending[call_id] = (self._inputs_ok(args, kwargs, not name, mask_at),
                                     tuple(self.stack))
            self.versions[call_id] = input_versions(args, kwargs)
            # (a module called from several lines: its call's own, for the report)
            self.called_at[call_id] = caller_source(inspect.currentframe())
            # until it returns: a call the model raises in (a validate_args check) never does
            self.result.open[call_id] = (name, self.runner.micro_batch, self.pending[call_id])
            if (ok := statistics_finite(module)) is not None:
                self.stats_before[call_id] = ok
            self.stack.append(call_id)
        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            if self.stack:
                call_id = self.stack.pop()
                # (the running statistics it wrote non-finite, its outputs finite: an outlier
                # record's overflowed variance, recorder.running_stats)
                wrote = statistics_kind(module) if self.stats_before.pop(call_id, False) \
                    else None
                self._record(name, call_id, output, self._of_weights(args, kwargs), wrote)
                written = wrote_in_place(self.versions.pop(call_id, []))
                self.result.calls[-1].returned_input = returned_input(output, args, kwargs) \
                    or written
        return hook

    def _output_pairs(self, outs: list[torch.Tensor]) -> list[tuple[float, float]]:
        """(min, max) of each output: one stacked read for those not seen before."""
        pairs = [self.checked.get(t) for t in outs]
        todo = [i for i, p in enumerate(pairs) if p is None]
        if todo:
            fresh = torch.stack([ends(real_view(outs[i])) for i in todo]).tolist()
            for i, pair in zip(todo, fresh):
                pairs[i] = tuple(pair)
        return pairs

    def _of_weights(self, args, kwargs) -> bool:
        """The call took tensors, every one the model's parameter or buffer (a
        parametrization's ``original``): its output's rows are no samples, whatever their
        number (a weight of as many rows as the batch has samples)."""
        given = tensor_leaves([list(args), kwargs])
        return bool(given) and all(id(t) in self.weights for t in given)

    def _record(self, name: str, call_id: int, output, of_weights: bool = False,
                wrote: str | None = None) -> None:
        (ok_in, every_in, nan_free_in), parents = self.pending.pop(call_id)
        self.result.open.pop(call_id, None)
        inf_ok: set[int] = set()  # (a distribution's logits, as the recorder checks them)
        outs = [t for t in output_leaves(output, inf_ok)
                if t.is_floating_point() or t.is_complex()]  # (empty: (0, 0), as recorded)
        allowed = name in self.runner.allowed
        pairs = self._output_pairs(outs)
        ok_out = all(pair_ok(lo, hi, allow_inf=allowed or id(t) in inf_ok)
                     for t, (lo, hi) in zip(outs, pairs))
        kind = next((pair_kind(lo, hi) for lo, hi in pairs if not pair_ok(lo, hi)), None)
        if wrote is not None:
            ok_out, kind = False, kind or wrote
        for t, pair in zip(outs, pairs):
            self.checked.put(t, pair)
            if allowed:
                self.produced_allowed.add(t)
        mm = tuple(tuple(repr(v) for v in pair) for pair in pairs)
        mb = self.runner.micro_batch
        k = self.counts.get((name, mb), 0)
        self.counts[(name, mb)] = k + 1
        rows = (_output_rows(outs, samples(self.runner.step, mb), packed_in(output))
                if not ok_out and not of_weights else [])
        nan = any(math.isnan(lo) or math.isnan(hi) for lo, hi in pairs) or kind == "nan"
        bits, sums = _digests(outs, getattr(self.runner, "digest_sums", False))
        self.result.calls.append(Call(len(self.result.calls), name, k, mb, ok_in, ok_out, kind,
                                      mm, parents, call_id, rows, nan, every_in, nan_free_in,
                                      running_node() is not None,
                                      self.called_at.pop(call_id, None),
                                      statistic=wrote is not None, bits=bits, sums=sums))


def _digests(outs: list[torch.Tensor], with_sums: bool
             ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Each output's values read as integers and summed (one host read): two runs whose
    outputs differ in any bit, where their (min, max) may not, differ here. ``with_sums``:
    also each output's finite values' sum and absolute sum (a second read), which tell
    rounding from another computation (``Run.same_but_rounding``: asked for only then, by
    ``runner.digest_sums``, which replay.diverging_op sets)."""
    bits, sums = [], []
    with torch.no_grad():
        for t in outs:
            if (x := as_integers(t)) is None:
                continue
            bits.append(x.sum(dtype=torch.int64))
            if with_sums:
                x = real_view(t)
                ok = torch.where(torch.isfinite(x), x, 0)  # (summed in float64, not copied)
                sums.append(torch.stack([ok.sum(dtype=torch.float64),
                                         ok.abs().sum(dtype=torch.float64)]))
    return (tuple(torch.stack(bits).tolist()) if bits else (),
            tuple(torch.stack(sums).flatten().tolist()) if sums else ())


def returned_input(output, args, kwargs) -> str | None:
    """The type's name of ``output`` when it is a container (no tensor) the call was given as
    an argument; else None."""
    given = not isinstance(output, torch.Tensor) and output is not None and any(
        output is a for a in (*args, *(kwargs or {}).values()))
    return type(output).__name__ if given else None


def input_versions(args, kwargs) -> list[tuple[torch.Tensor, int | None]]:
    """Each input tensor with its version counter, to tell afterwards whether the call wrote
    into it in place (None: an inference tensor, which keeps none)."""
    return [(t, version_of(t)) for t in tensor_leaves([list(args), kwargs])]


def wrote_in_place(versions: list[tuple[torch.Tensor, int | None]]) -> str | None:
    """``IN_PLACE`` when the call wrote into one of its input tensors (a ``mark_dirty``
    autograd.Function, ``x.log_()`` on the argument): the recorder, reading a call's inputs
    after it returns, saw them as the call left them; else None."""
    return IN_PLACE if any(version_of(t) != v for t, v in versions) else None


def _output_rows(outs: list[torch.Tensor], where: Samples, packed: dict) -> list[int]:
    """The non-finite samples of a call's first batched non-finite output (a weight made in the
    forward, with no dimension of the batch's size, names none; nor does a 0-d output, a loss
    computed in the model); the ``data`` of a ``PackedSequence`` in ``packed`` names them
    through it."""
    return next((where.rows(t, packed, stacked=True) for t in outs if t.dim() and not finite(t)), [])
