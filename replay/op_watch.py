"""Watching each aten op for :class:`~replay.ops.OpFinder`: its inputs' ends before it runs, its
outputs' after; the first op that made a non-finite value of finite ones (with its evidence),
the first that made NaN of NaN-free ones, the first reduction that folded an infinity in, and
an intended infinity's start, kept on the finder."""

from __future__ import annotations

from recorder.finite import pair_kind

from . import empty_rows
from .compared_after import after_origin
from .compat import TorchDispatchMode, running_node, tree_leaves
from .dispatch import clone_args, float_leaves, run_op
from .folds import folds
from .fresh import POINTWISE
from .hits import OpHit, with_caller
from .lineage import pole_inputs
from .literal_fill import literals, nan_number
from .masked_product import mask_after_pole
from .nan_rows import nan_rows
from .op_evidence import made_beside, op_evidence
from .op_inputs import input_ends as _input_ends
from .other_rows import bad_grid, lead_rows
from .own_ops import adopt, inner_hit, inputs_of, made_by, op_name, writes_into
from .saturated import taken_back_exactly, took_back
from .source import user_source
from .uninitialised import PASSED_OVER

# Ops whose later outputs are workspaces for backward, partly uninitialised (CTC's log_alpha
# beyond a row's input length): only the first outputs are results.
_RESULTS = {"_ctc_loss": 1, "_cudnn_ctc_loss": 1}


class Watch(TorchDispatchMode):
    """The dispatch mode of an :class:`~replay.ops.OpFinder`: each aten op checked before it
    runs for finite inputs and after for its output, the offenders kept on the finder."""

    def __init__(self, finder):
        super().__init__()
        self.finder = finder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, f = kwargs or {}, self.finder
        if f.first is not None and f.first_nan is not None:  # (the rows its call made next)
            return after_origin(f, func, args, kwargs)
        occurrence, seq = f.count(name := func.overloadpacket.__name__)
        leaves, ins = tree_leaves((args, kwargs)), inputs_of(func, args, kwargs)  # (not out=)
        literal_inf, filled, ins = literals(name, leaves, ins)
        pairs, lo, hi, in_finite, in_nan_free = _input_ends(ins)
        # an op writing into its arguments: keep what it was given, for the evidence
        before = clone_args(args, kwargs) if f.first is None and writes_into(func) \
            and (in_finite or POINTWISE in func.tags) else None
        out = run_op(func, args, kwargs)
        f.follow(name, args, leaves, out)
        outs = made_by(func, args, kwargs, out, float_leaves(out)[:_RESULTS.get(name)])
        if not outs or name in PASSED_OVER:
            return f.unwritten.allocated(name, out, op_name(func), occurrence, seq, f.where)
        f.track(name, ins, outs, in_finite, leaves, (args, kwargs), func, out)
        if (out_ends := f.ends_of(name, outs)) is None:
            # an infinity taken back to finite values (exp(-inf) = 0) before any NaN
            took_back(f, name, not in_finite and in_nan_free and f.first_nan is None)
            return out
        # the first output's kind, NaN before +Inf before -Inf within it
        made = next((k for k in (pair_kind(a, b) for a, b in out_ends) if k), None)
        op = op_name(func)  # (a custom op's own namespace: mylib.fused_norm)
        buffer = None if in_finite or made == "nan" else f.mask_buffer(ins, pairs)
        if buffer is not None:  # it passed on a mask buffer's +-inf: the intended start
            if f.first is None and f.intentional is None and not f.views_mask(out):
                f.intentional = OpHit(op, made, user_source(), None, None, True, occurrence,
                                      True, rows=f.batch_rows(outs), buffer=buffer)
            return out
        if made == "nan" and (calling := f.composites.nan_constant(ins, leaves, seq)):
            return f.composite(calling, occurrence, out)  # (torch.logdet's own NaN constant)
        intentional = literal_inf is not None or filled or f.allows(made, in_finite)
        if in_finite and f.starts(made, intentional):
            hit = OpHit(op, made, user_source(), lo, hi, intentional, occurrence, True,
                        rows=f.batch_rows(outs), param=f.param_among(ins, name), within=f.where,
                        node=running_node(), seq=seq, literal=nan_number(name, leaves))
            if intentional:
                if f.intentional is None or f.taken_back():
                    f.intentional = hit
            else:
                given = before if before is not None else (args, kwargs)
                try:
                    hit.evidence = f.of_records(op_evidence(func, given, outs, f),
                                                pole_inputs(op, ins), hit.rows, leaves, op)
                except Exception:  # evidence helps the cause; the op is named without it
                    hit.evidence = None
                f.first = with_caller(adopt(hit, inner_hit(func, args, kwargs, f)))  # (own_ops)
        elif f.first is None and not intentional and made not in f.passed_kinds:
            f.first = made_beside(func, op, before or (args, kwargs), outs, occurrence, f)
        if not in_finite and in_nan_free and made != "nan" and f.first_reduced is None \
                and folds(func, outs[0], pairs, ins):
            f.first_reduced = OpHit(op, made, user_source(), lo, hi, occurrence=occurrence,
                                    rows=f.folded_rows(outs, func, args, ins, pairs), seq=seq,
                                    grid=bad_grid(outs[0]), picked=f.picked)
        if made == "nan" and in_nan_free and f.first_nan is None:
            f.first_nan = _nan_hit(f, func, before or (args, kwargs), ins, outs, in_finite,
                                   OpHit(op, "nan", user_source(), lo, hi, filled, occurrence,
                                         in_finite, literal=literal_inf, seq=seq))
        return out


def _nan_hit(f, func, given, ins, outs, in_finite: bool, hit: OpHit) -> OpHit:
    """``hit``, the first op that made NaN of NaN-free values, with where it ran and its rows;
    with its evidence too when :meth:`OpFinder.blamed` may blame it (made of finite values
    after an exact infinity that an op took back to finite ones)."""
    hit.within, hit.rows, hit.node = f.where, f.batch_rows(outs), running_node()
    if not in_finite:  # (infinities it passed on: the rows it made NaN in are the samples)
        hit.rows = nan_rows(f.batch_rows, outs, hit.rows)
    hit.lead_rows = None if hit.rows else lead_rows(outs[0])
    empty_rows.mark(hit, f.first is None and bool(f.intentional), ins, outs[0])
    # (inf * a mask's 0; a log's -inf times its own 0 or a target's)
    mask_after_pole(f.first, func.overloadpacket.__name__, given[0], hit, f.lineage)
    if in_finite and taken_back_exactly(f):
        try:
            hit.evidence = f.of_records(op_evidence(func, given, outs, f), ins, hit.rows)
        except Exception:  # (evidence helps the cause; the op is named without it)
            hit.evidence = None
    return hit
