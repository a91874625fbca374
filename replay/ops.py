"""Naming the aten op that made a non-finite value, with the user's source line.

:class:`OpFinder` wraps a ``TorchDispatchMode`` subclass, :class:`replay.op_watch.Watch` (the
dispatch mode comes from :mod:`replay.compat`): inside it every aten op is checked, before it
runs, for finite inputs and, after, for its output. Two offenders are kept:

- the first op with all-finite inputs and a non-finite output (``first``), unless the
  infinity is intentional: a literal +-inf argument (``masked_fill(mask, -inf)``, ``full``) or
  an op inside a module allowed to hold infinities; those are remembered as the chain's start.
  A pointwise op given non-finite values (a -inf mask) counts too where it made non-finite
  values of finite ones (the masked scores divided by a temperature of 0: ``replay.fresh``);
- the first op with NaN-free inputs and a NaN output (``first_nan``): the op that turned
  infinities, intentional or not, into NaN (``inf - inf``, ``0 * inf``, softmax of a -inf row).

The float64 re-run's own modes are in :mod:`replay.dispatch`.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import torch

from recorder.finite import ends, finite, kind_of, pair_ok
from recorder.samples import Samples

from . import batch_overflow, clamped_divisor, data_counts, data_factor, positive_counts
from .cancellation import Cancellation
from .compat import tree_leaves
from .composite import Composites, composite_hit
from .earlier_nan import earlier_nan
from .exp_param import ExpOfParam
from .folds import folded_inputs
from .hits import Evidence, OpHit
from .landed_rows import land_rows
from .lineage import Lineage
from .lost_eps import LostEps
from .made_of_params import made_of
from .masked_product import nan_times_mask, nan_times_zero
from .memo import TensorMarks, TensorSet
from .moved import Moved
from .nonzero import NonZero
from .op_watch import Watch
from .param_names import ParamNames
from .picked_fill import note_pick
from .pooled import Pooled
from .positive import Partly, made_sign, positive_result
from .read_numbers import ReadNumbers
from .recurring import widen_rows
from .reordered import Reordered
from .saturated import superseded, taken_back_exactly
from .saturation import Saturation, made_mix, made_unit
from .shifted_positive import shifted_maker
from .source import user_source
from .storages import storage_of
from .strided_nested import on_strided_nested
from .underflow_advice import PICKS, made_by_exp
from .uninitialised import Unwritten
from .zero_operand import ZeroOperand


class OpFinder:
    """Context manager: ``with OpFinder() as f: run(); f.first, f.first_nan, f.chain()``.

    ``allowed_depth`` is raised by the caller while code of a module allowed to hold
    infinities runs, so infinities made there count as intentional.
    """

    masked_by_mask = False  # (``masked_nan``'s 0 a 0/1 mask's, not data's own)
    given_in: torch.dtype | None = None  # a loss's: the autocast its inputs were made in

    def __init__(self, samples: Samples | None = None, mask_buffers: dict[int, str] | None = None):
        self.first: OpHit | None = None
        # the model's buffers holding +-inf and no NaN (causal masks), by storage: an op
        # whose only non-finite inputs are views of one passes on an intended infinity
        self.mask_buffers = mask_buffers or {}
        self.first_nan: OpHit | None = None
        self.differentiated = False  # (a backward node ran after the origin: forces' autograd.grad)
        # kinds not taken for first (a NaN, when a backward node saved an infinity)
        self.passed_kinds: tuple[str, ...] = ()
        self.picked: OpHit | None = None  # an index op that took a fill's +-inf (picked_fill)
        self.absorbed = False  # an op made finite values of infinities before the first NaN
        self.unsaturated = False  # one not a clamp's, a min's or a where's (replay.saturated)
        self.masked_nan: OpHit | None = None  # the first NaN * 0 (a 0/1 mask times missing values)
        self.intentional: OpHit | None = None
        self.unwritten = Unwritten()  # allocations holding NaN (torch.empty's, deterministic)
        # the first reduction (sum, mean, nll_loss) that folded an infinity it was given into
        # a non-finite result: where a loss took in a -inf its inputs were allowed to hold
        self.first_reduced: OpHit | None = None
        self.allowed_depth = 0
        self.samples = samples  # name the samples of the first offender's output
        self.reordered = Reordered(samples.size if samples and samples.size else 0)  # x[order]
        self.pooled = Pooled(samples, self.reordered.order)  # no samples: pools (its tokens)
        self.moved = Moved(samples)  # and their samples in another dim (stack(per_scale))
        self.counts: dict[str, int] = {}  # calls of each op so far, to find the same call again
        self.seen = 0  # calls of every op so far
        self.made_in: set[torch.dtype] = set()  # the floating types the watched ops made
        self.sizes: dict[str, list[float]] = {}  # each op's finite calls' largest magnitude
        self._positive = TensorSet()  # tensors exact arithmetic keeps > 0
        self.exps = TensorSet()  # exp's own results (a log of one: replay.underflow_advice)
        self.shifted = TensorMarks()  # softplus(s) + min_std's maker (replay.shifted_positive)
        self.exp_param = ExpOfParam()  # exp of a parameter (a policy's log_std.exp())
        self.partly = Partly()  # and those it keeps > 0 at some positions (a bool mask each)
        self.saturation = Saturation()  # and 1 - tanh(u)², which rounding can make 0
        self.cancellation = Cancellation()  # and E[x²] - E[x]², which it can make < 0
        self._mode = Watch(self)
        self.composites = Composites()  # where torch.logdet runs (replay.composite)
        self.lost_eps = LostEps()  # t + eps where t's type rounds eps to 0 (replay.lost_eps)
        self.read = ReadNumbers()  # the numbers .item() read (replay.read_numbers)
        self.zero_operand = ZeroOperand()  # mm's lines an operand's 0 line zeroed
        self.names = ParamNames()  # the model's parameters by name (its caller indexes them)
        # the innermost module call running now, (name, call), as its caller tracks it
        self.where: tuple[str, int] | None = None
        # ``counts`` as each such call began: an op's occurrence counted from there
        self.entered: dict[tuple[str, int], dict[str, int]] = {}
        self.scripted: list[tuple[str, int, int, int]] = []  # TorchScript calls' op spans: called_at
        # (data_ptr, shape) of its parameters and buffers (set by that caller too), and the
        # tensors made from them alone: a learned per-class scale of the batch's length holds
        # classes, not samples, in its rows
        self.state: set[tuple[int, tuple]] = set()
        self._of_weights = TensorSet()
        # the first op (with ``state`` set) that took a non-finite input, not made from the
        # weights alone, and made non-finite values: where weights bad before the step met the
        # batch (an embedding looking up a NaN row), which no op made from finite inputs
        self.first_met: OpHit | None = None
        # the first such op that took the weights and buffers alone (``state``): a loss's
        # buffer non-finite before the step (EWC's Fisher) times the parameters
        self.first_held: OpHit | None = None
        # where values without a batch dimension came from (a loss's per-image loop), when
        # the caller seeds one
        self.lineage: Lineage | None = None

    def index_params(self, named, buffers=()) -> None:
        """Name the parameters ``named`` yields (``model.named_parameters()``), the buffers."""
        self.names.index(named, buffers)

    def param_among(self, ins: list[torch.Tensor], op: str | None = None) -> str | None:
        """The parameter the op's one input (a division's divisor) is: replay.param_names."""
        return self.names.among(ins, op, hit=True)

    def positive(self, t: torch.Tensor) -> bool:
        """``t`` came from exp/softmax/sigmoid of a finite argument: its zeros underflowed.
        Seen run here, or, for a value made before (the model output a loss takes), on its
        autograd graph (not where exp here had -inf: partly positive, whose graph says all)."""
        return t in self._positive or self.partly.mask(t) is None and made_sign(t.grad_fn) > 0

    @cached_property
    def nonzero(self) -> NonZero:  # (and != 0 of either sign: exp(s) * polarity)
        return NonZero(self)

    def mark_made_by(self, fn, t: torch.Tensor) -> None:
        """``t`` stands for a value autograd node ``fn`` made, where no graph says so (a
        detached copy): one exp/softmax made stays positive, one tanh/sigmoid made stays
        strictly inside (-1, 1) (its ``1 - y`` cannot be 0 in exact arithmetic)."""
        if made_sign(fn) > 0:
            self._positive.add(t)
        self.nonzero.mark(fn, t)
        self.partly.mark_filled(fn, t)  # (a softmax over a fill: positive where non-zero)
        if made_by_exp(t, fn=fn):
            self.exps.add(t)
        if op := shifted_maker(t, fn=fn):
            self.shifted.put(t, op)
        self.exp_param.mark(fn, t, self.names)
        if made_unit(fn):
            self.saturation.mark_unit(t, mixed=made_mix(fn))

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
              in_finite: bool, leaves: list, given: tuple = ((), {}), func=None, out=None
              ) -> None:
        if func is not None:  # (rows later ops of the origin's module call made: recurring)
            widen_rows(self, func, *given, out)
        land_rows(self, leaves, outs)  # (an origin without rows: where its values land)
        self.pooled.track(name, *given, ins, outs, self.held)
        # exp of -inf scores: positive where they are not -inf; a sum of it, where any term is
        if func is not None and (m := self.partly.track(func, name, given, ins, outs,
                                                        self.positive)) is not None \
                and bool(m.all()):
            self._positive.add(outs[0])
        self.made_in.update(t.dtype for t in outs)
        self.names.track(name, ins, outs)
        if name in ("exp", "exp_") or name in PICKS and ins and ins[0] in self.exps:
            self.exps.add(outs[0])
        weights_only = bool(self.state) and self._of_weights_only(leaves)
        if self.first is None:  # (the writes before the origin: replay.batch_written)
            self.names.written.track(func, name, given[0], weights_only, self.names)
        if weights_only:  # (and a complex result itself, which ``outs`` holds as a real view)
            for t in outs + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]:
                self._of_weights.add(t)
        self.saturation.track_softmax(name, ins, outs, leaves)  # (its -inf entries too)
        if not in_finite:
            if self.first is None and self.first_nan is None and (
                    hit := self.unwritten.read(ins, outs, self.batch_rows)):
                self.first = self.first_nan = hit  # (read unwritten: replay.uninitialised)
            note_pick(self, name, ins, outs)  # (a masked action's -inf gathered)
            if self.state and not weights_only and self.first_met is None:
                self._meet(name, outs)
            elif weights_only and self.first_held is None:  # (a loss's NaN buffer times p)
                self.first_held = self._made_hit(name, outs)
            if self.masked_nan is None and nan_times_zero(name, given[0]):
                self.masked_nan = OpHit(f"aten.{name}", "nan", user_source(), None, None,
                                        within=self.where)
                self.masked_by_mask = nan_times_mask(name, given[0])
            return
        if any(isinstance(t, torch.Tensor) and t.is_complex() for t in leaves):
            return  # (exp of a complex number is no positive real: its parts, real views here)
        if positive_result(name, ins, leaves, self.positive) or self.nonzero.track(
                name, ins, leaves, outs) == 1:  # (or > 0 of a value != 0: amp ** 2)
            for t in outs:
                self._positive.add(t)
        self.exp_param.track(name, ins, outs, leaves, self.names)
        self.saturation.track(name, ins, outs, leaves)
        self.cancellation.track(name, ins, outs, leaves)

    def _meet(self, name: str, outs: list[torch.Tensor]) -> None:
        self.first_met = self._made_hit(name, outs)

    def _made_hit(self, name: str, outs: list[torch.Tensor]) -> OpHit | None:
        made = next((kind_of(t) for t in outs if not finite(t)), None)
        if made is not None:  # (a Linear's mm on the flattened batch: its rows are not samples)
            return OpHit(f"aten.{name}", made, user_source(), None, None,
                         rows=self.batch_rows(outs), within=self.where)
        return None

    def held(self, t: torch.Tensor) -> bool:
        """``t`` is a parameter or buffer, or was made from them alone."""
        try:
            return t in self._of_weights or (t.data_ptr(), tuple(t.shape)) in self.state \
                or (storage_of(t), None) in self.state
        except RuntimeError:  # a tensor without storage
            return False

    def _of_weights_only(self, leaves: list) -> bool:
        """Every tensor an op took is a parameter or buffer, or was made from them alone."""
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        return bool(tensors) and all(self.held(t) for t in tensors)

    def mask_buffer(self, ins: list[torch.Tensor], pairs) -> str | None:
        """The mask buffer that every non-finite input of an op is a view of, or None."""
        if not self.mask_buffers:
            return None
        names = {self.mask_buffers.get(storage_of(t))
                 for t, (a, b) in zip(ins, pairs) if not pair_ok(a, b)}
        return None if None in names or len(names) != 1 else names.pop()

    def views_mask(self, out) -> bool:
        return any(isinstance(t, torch.Tensor) and storage_of(t) in self.mask_buffers
                   for t in tree_leaves(out))

    def starts(self, made: str | None, intentional: bool) -> bool:
        """Whether a non-finite value (``made``) an op made of finite ones starts the chain:
        none did before, or the first one's infinities were taken back exactly before any NaN
        (:func:`~replay.saturated.superseded`) and this one is no intended fill."""
        return made not in self.passed_kinds and (
            self.first is None or not intentional and superseded(self))

    def in_allowed_module(self) -> bool:
        return self.allowed_depth > 0

    def taken_back(self) -> bool:
        """An op took the infinities so far back to finite values (a padding mask's -inf under
        softmax) before any NaN: a later fill (SUBS's -inf logit) is the one still live."""
        return self.absorbed and self.first_nan is None

    def allows(self, made: str | None, in_finite: bool) -> bool:
        """allow_inf allows infinities, not a NaN an allowed module makes of finite values
        (log of a rounded negative in the root's own code): that NaN is blamed, with evidence."""
        return self.in_allowed_module() and not (made == "nan" and in_finite)

    def follow(self, name: str, args, leaves: list, out) -> None:
        """Where the op's outputs came from, when a lineage is kept (integer and bool values
        too: a loss's matches, masks, labels)."""
        self.composites.see(name, args, self.seen - 1)
        if on_strided_nested(leaves, out):  # (math attention's: its values go unread)
            return
        self.lost_eps.track(name, args, out)
        self.read.track(name, out)
        self.zero_operand.track(name, args, out)
        self.reordered.track(name, args, leaves, out)
        self.moved.track(name, args, leaves, out)
        if self.lineage is not None:
            self.lineage.track(name, args, leaves, out)
            if (ev := self.first and self.first.evidence) is not None and ev.of_data:
                ev.compared = self.first.op.removeprefix("aten.").rstrip("_") \
                    in self.lineage.compared

    def of_records(self, ev: Evidence, ins: list[torch.Tensor], rows: list[int] | None,
                   leaves: list | None = None, op: str = "") -> Evidence:
        """``ev``, marked ``of_data`` when the op computed on data alone (see
        :mod:`replay.lineage`) in some of the samples: the mark of bad records, not of code
        that does so in every sample; ``of_weights`` when on the weights alone (of ``leaves``,
        its arguments, whose complex tensors ``ins`` holds as real views)."""
        ev.of_data = self.lineage is not None and self.lineage.of_data(ins) and bool(rows) \
            and len(rows) < self.samples.size
        ev.counts = data_counts.marked(op, ins) if ev.of_data else ""  # (log(total) of no read)
        ev.data_divisor = "" if ev.of_data else positive_counts.marked(  # (x_hat / x.norm() 0)
            self.lineage, op, ins, rows, self.samples.size if self.samples else 0, leaves)
        ev.cut_divisor = clamped_divisor.cut_in_forward(op, ins)  # (a relu diffusion's 0)
        ev.unlearned = batch_overflow.unlearned(self.lineage, ins, rows, self.samples)
        ev.data_factor = data_factor.marked(  # (g * dt.sqrt() of a dt of 0)
            op, ins, rows, self.samples.size if self.samples else 0)
        ev.of_weights = bool(self.state) and self._of_weights_only(
            [t for t in (ins if leaves is None else leaves) if isinstance(t, torch.Tensor)
             and (t.is_floating_point() or t.is_complex())])
        ev.made_of = made_of(ins, self.names.params) if ev.of_weights else []
        ev.narrowest = min(self.made_in, key=lambda d: torch.finfo(d).bits, default=None)
        ev.given_in = self.given_in
        return ev

    def batch_rows(self, outs: list[torch.Tensor]) -> list[int] | None:
        """Non-finite samples of the first output that has the batch's samples (none made from
        the weights alone)."""
        s = self.samples
        # (samples an op moved, stack; or flattened with the next dims, reshape(-1, 2))
        if (shaped := self.moved.rows([t for t in outs if t not in self._of_weights
                                       and t not in self.pooled])) is not None:
            return shaped if self.lineage is None else self.lineage.rows(outs[0], shaped)
        # (stacked: a value made from the batch, where (K, B, ...) stacks its copies)
        t = next((t for t in outs if s and s.size and (s.dim(t, stacked=True) is not None
                                                      or s.per_node(t))
                  and t not in self._of_weights and t not in self.pooled), None)
        shaped = None if t is None else s.rows(t, stacked=True)
        if t is not None and s.dim(t, stacked=True) == 0:  # (rows of a sorted batch: samples)
            shaped = self.reordered.samples(t, shaped)
        elif t is None:  # (values a mask picked out of the batch: ``log(pred[valid])``)
            shaped = self.reordered.picked_rows(outs)
        return shaped if self.lineage is None else self.lineage.rows(outs[0], shaped)

    def folded_rows(self, outs: list[torch.Tensor], func, args, ins: list[torch.Tensor],
                    pairs) -> list[int] | None:
        """The samples of a reduction's non-finite output; of a 0-d one (a loss's mean over
        the batch), those of the non-finite inputs it folded in (``folds.folded_inputs``)."""
        return self.batch_rows(outs) or self.batch_rows(
            folded_inputs(func, args, ins, pairs, self.moved))

    def __enter__(self) -> OpFinder:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def ends_of(self, name: str, outs: list[torch.Tensor]) -> list | None:
        """Each output's (min, max), or None when every one is finite (one host read); a
        finite call's largest magnitude is kept for op ``name`` (its earlier calls growing:
        a diverging loop, :mod:`replay.upstream`)."""
        with torch.no_grad():  # aminmax: one pass, no temporary (isfinite().all() is slow)
            pairs = torch.stack([ends(t) for t in outs]).tolist()
        if all(math.isfinite(v) for pair in pairs for v in pair):
            self.sizes.setdefault(name, []).append(max(abs(v) for pair in pairs for v in pair))
            return None
        return pairs

    def composite(self, calling, occurrence: int, out):
        """Blame the composite function ``calling`` (``(torch.logdet, its input)``), whose own
        code made a NaN constant, when its result is non-finite; pass ``out`` on."""
        if self.first is None and (hit := composite_hit(self, *calling, occurrence)):
            self.first = hit
            self.first_nan = self.first_nan or hit
        return out

    def origin(self) -> OpHit | None:
        """The op to blame: the first unintentional non-finite maker, else the NaN maker."""
        return self.first or self.first_nan

    def blamed(self, made: str | None = None) -> OpHit | None:
        """:meth:`origin`, unless a reduction folded an intended fill into -inf before the NaN
        (a log-domain Sinkhorn's fully forbidden row), a NaN came first in a NaN result ``made``
        (``earlier_nan``), or the first infinity is exact (a log of 0 given) and an op took it
        back to finite values (exp(-inf) = 0) before the NaN was made of finite ones."""
        if self.intentional is not None and (reduced := self.reduced_first()) is not None:
            return reduced
        if (earlier := earlier_nan(self.first, self.first_nan, made)) is not None:
            return earlier
        n = self.first_nan
        if n is not None and n.inputs_finite and taken_back_exactly(self):
            # log(0) of a weight of 0 (a padded point's, in log-domain OT), which exp took
            # back to an exact 0: the NaN was made later of finite values (0 / 0)
            return n
        return self.origin()

    def count(self, name: str) -> tuple[int, int]:
        """(calls of op ``name``, calls of any op) before this one, counting this one."""
        occurrence, seq = self.counts.get(name, 0), self.seen
        self.counts[name], self.seen = occurrence + 1, seq + 1
        return occurrence, seq

    def reduced_first(self) -> OpHit | None:
        """``first_reduced`` when no op made a non-finite value of finite inputs and it came
        before any NaN (not a later, unrelated reduction: a cross entropy summing the -inf of
        a mask after a KL's 0 * -inf had made the NaN)."""
        r, n = self.first_reduced, self.first_nan
        return r if self.first is None and r and (n is None or r.seq < n.seq) else None

    def chain(self, made: str | None = None) -> list[dict[str, Any]]:
        """Where the first non-finite value came from and where the first NaN was made (not
        an exact infinity taken back to finite values before it: :meth:`blamed`)."""
        out = []
        start = None if self.first and self.blamed(made) is self.first_nan else \
            self.first or self.intentional
        if start is not None:
            out.append(start.as_json())
        # the op that made NaN of it, or else the reduction that folded it in (a -inf mask);
        # not a NaN made before it, of other values (a masked pair's -inf - -inf, dropped)
        end = self.reduced_first() or self.first_nan
        if end is not None and (start is None or (start.made, start.op) != (end.made, end.op)
                                and end.seq > start.seq):
            out.append(end.as_json())
        return out
