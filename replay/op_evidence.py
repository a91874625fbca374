"""What the op finder keeps of one op at its non-finite outputs: the op's values there, with the
op re-run in float64 on them (:func:`op_evidence`), and the hit of a pointwise op that made
non-finite values beside the non-finite ones it was given (:func:`made_beside`)."""

from __future__ import annotations

import math

import torch

from .chain_product import chain_length
from .compat import running_node, tree_leaves, tree_map
from .dispatch import float_leaves
from .factors import made_by
from .float64 import as_float64, upcast
from .fresh import fresh_positions, inputs_there, made_there
from .hits import Evidence, OpHit
from .op_inputs import values_at
from .operator_power import radii
from .own_ops import made_by as made_by_op
from .positive_maker import positive_maker
from .shifted_positive import shifted_maker
from .source import user_source
from .underflow_advice import made_by_exp

__all__ = ["made_beside", "op_evidence"]


def made_beside(func, op: str, given, outs: list[torch.Tensor], occurrence: int,
                 f) -> OpHit | None:
    """The hit of a pointwise op that made non-finite values from finite ones where other
    inputs it took were non-finite already (see :mod:`replay.fresh`), or None. Not for a
    complex op: it mixes the real and imaginary parts, so a NaN real part it was given makes
    the imaginary part NaN, which the real views' positions would take for a new NaN."""
    if any(isinstance(t, torch.Tensor) and t.is_complex() for t in tree_leaves(given)):
        return None
    ins = float_leaves(given)
    made = fresh_positions(func, ins, outs[0])
    if made is None:
        return None
    lo, hi = inputs_there(ins, made, outs[0].shape)
    marked = torch.zeros(outs[0].shape).masked_fill_(made.cpu(), math.nan)  # (its rows)
    hit = OpHit(op, made_there(outs[0], made), user_source(), lo, hi, False, occurrence, True,
                rows=f.batch_rows([marked]), within=f.where, node=running_node())
    try:
        hit.evidence = op_evidence(func, given, outs, f, bad=made)
    except Exception:  # (as for an op of finite inputs: named without it)
        hit.evidence = None
    return hit


def op_evidence(func, given, outs: list[torch.Tensor], f,
              bad: torch.Tensor | None = None) -> Evidence:
    """What the cause needs of the op's values where its first non-finite output is
    non-finite (or at ``bad``, over its first output: the values it made itself); ``f`` is the
    :class:`~replay.ops.OpFinder` that watched the op."""
    args, kwargs = given
    if bad is None:
        k = next(i for i, t in enumerate(outs) if not bool(torch.isfinite(t).all()))
        bad = ~torch.isfinite(outs[k].detach())
    else:
        k = 0
    ins = float_leaves((args, kwargs))
    taken = [values_at(t, bad) for t in ins]
    local = None
    if torch.Tag.nondeterministic_seeded not in func.tags:  # a re-run would draw random numbers
        a64, k64 = as_float64(func, upcast(args), upcast(kwargs))
        try:
            with torch.no_grad():
                out64 = func(*a64, **k64)
            # (and the statistics it wrote in float64, after its results: replay.own_ops)
            r = made_by_op(func, a64, k64, out64, float_leaves(out64))
            if k < len(r) and r[k].shape == bad.shape:
                local = r[k].detach()[bad]
        except Exception:  # an op that refuses float64 (a fused kernel): no local answer
            local = None
    plain = tuple(tree_map(lambda v: None if isinstance(v, torch.Tensor)
                           and (v.is_floating_point() or v.is_complex()) else v, list(args)))
    return Evidence(dtype=outs[k].dtype, bad=bad, inputs=[v for v, _ in taken],
                    input_dtypes=[t.dtype for t in ins], elementwise=[e for _, e in taken],
                    exp_made=[f.nonzero(t) or f.partly.at(t, bad) for t in ins],
                    squared=[f.partly.squared(t) for t in ins],
                    signed=[f.nonzero.signed(t) for t in ins],
                    of_exp=[t in f.exps or made_by_exp(t) for t in ins],
                    trig=[f.cancellation.trig.of(t) for t in ins],
                    chained=[chain_length(t) for t in ins],
                    shifted=[f.shifted.get(t) or shifted_maker(t) for t in ins],
                    positive_by=[positive_maker(t) for t in ins],
                    exp_param=[f.exp_param.of(t) for t in ins],
                    local64=local,
                    complement=[f.saturation.complement(t) for t in ins],
                    power=[f.saturation.power(t) for t in ins],
                    mixed=[f.saturation.mixed(t) for t in ins],
                    zero_dim=[t.dim() == 0 for t in ins], factor=[made_by(t) for t in ins],
                    sizes=list(f.sizes.get(func.overloadpacket.__name__, ())),
                    lost_eps=[f.lost_eps.of(t) for t in ins],
                    terms=[f.cancellation.at(t, bad) for t in ins],
                    others=[t.detach() for i, t in enumerate(outs) if i != k], output=k,
                    empty=any(isinstance(t, torch.Tensor) and t.is_floating_point()
                              and t.numel() == 0 for t in tree_leaves((args, kwargs))),
                    args=plain, read=f.read.of(plain), param_shift=f.names.hit_divisor_shifted,
                    radii=radii(func.overloadpacket.__name__, ins),
                    zero_operand=f.zero_operand.find(ins, bad),
                    unit_square=f.cancellation.unit_squares.at(ins[0], bad) if ins else 0)
