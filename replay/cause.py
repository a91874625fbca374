"""Why the value went non-finite, as IEEE 754 and numerical analysis name it.

The origin op (found by :class:`~replay.ops.OpFinder`, its :class:`~replay.ops.Evidence` taken
while it ran) and a re-run of the step in float64 tell the causes apart:

- the op computed again in float64 on its very inputs is finite: the true result only
  exceeded the dtype's range, ``overflow`` (logdet's sign its own LU rounded: precision);
- still non-finite, and the op has no pole or domain edge (exp, mul, a sum, a matmul): the
  true result is beyond float64 as well, ``overflow`` (clamp the exponent or the input range);
- still non-finite for an op with a pole or a domain (log, sqrt, division, CTC): its inputs
  are at the pole or outside the domain. The float64 re-run of the whole step, to that same op
  call, says whether exact arithmetic puts them there too:

  - the float64 op is finite: the dtype's rounding moved an input. An input that is 0 where
    float64 holds a value below the dtype's smallest normal number underflowed, ``underflow``;
    any other move (a cancelled variance below 0, a difference rounded to 0): ``precision``;
  - non-finite in float64 too: an input that is 0 and came from exp, softmax or sigmoid of a
    finite argument (directly, or gathered, sliced, divided, picked by top-k), or from a
    product of factors > 0 or a power of a base > 0, is positive in exact arithmetic,
    ``underflow`` (the hint: that op's log-space form; no wider type fixes it); else exact arithmetic makes the value too, ``invalid`` (log(0), x/0,
    log of a negative, 0/0, a CTC target that cannot be aligned);
- the op was given infinities (a ``-inf`` mask) and made NaN (inf - inf, softmax of an all
  ``-inf`` row): ``invalid``.

A backward origin is ``invalid`` when the float64 re-run's gradients are non-finite too (a
pole: sqrt at 0; 1 - y of a y below 1 rounded to 0 is ``precision``: replay.below_one). When
finite and an op with a pole saved an exact 0: ``underflow`` when that input came from exp,
softmax or sigmoid of a finite argument (sqrt(exp(-120))), else ``precision`` (rounding put it
on the pole: sqrt(1 - sigmoid(20)) in float32). Otherwise ``overflow``; without an op, the
float64 re-run alone decides (:mod:`replay.float64_step`'s; where the model refuses float64, a
half-only kernel, the op alone in float64 can still say ``overflow``, else the cause is left
open, ``None``, and the hint says why).
"""

from __future__ import annotations

import math

import torch

from recorder.finite import label

from . import (
    cancellation,
    domains,
    empty_rows,
    exact_edge,
    float64_inputs,
    half_clamp,
    lost_eps,
    residue,
    root_floor,
    rounded_column,
    saturation,
    uninitialised,
    upstream,
)
from .backward_cause import backward as _backward
from .cause_result import Cause
from .cause_text import (
    BELOW_FLOAT32,
    BEYOND_FLOAT64,
    DO,
    GROUP_REDUCTIONS,
    HINTS,
    INF_ARITH,
    MASK_ARITH,
    inf_arith,
    no_float64,
)
from .dispatch import OpAt
from .domains import g as _g
from .fill_overflow import fill_hint
from .float64_step import float64_still
from .forbidden_target import forbidden_target_hint
from .literal_fill import nan_number_hint
from .literal_range import literal_hint, unheld_literal
from .ops import Evidence, OpHit
from .past_edge import rounded_past_edge
from .picked_fill import folded_pick_hint
from .plus_inf_row import row_hint
from .positive import POSITIVE_OPS as _POSITIVE_OPS
from .positive_maker import WIDER as BELOW_FLOAT64
from .rerun import Runner
from .scaled_log import INNER_EXP, log_advice
from .selected_fill import selected_fill_hint
from .squared_zero import source as zero_source
from .step_dtype import autocast as _autocast
from .step_dtype import step_dtype as _step_dtype
from .underflow_advice import underflow_advice as advice
from .unit_complement import forward_hint as unit_forward_hint
from .wider_type import exp_factor as _exp_factor
from .wider_type import op_name as _name
from .wider_type import type_name as _type
from .wider_type import wider as _wider

__all__ = ["classify"]


# situations whose advice holds for a rounding that crossed the edge too (else: "stable")
_OWN_ADVICE = ("unit", "acosh", "atanh", "cholesky", "built_factor", "eigenvalues", "log_det",
               "singular", "m_matrix", "equal_rows", "fold")
# situations whose advice an op on data (or weights) alone replaces (of_data, of_weights)
_OF_RECORDS = ("pole", "log1p_pole", "domain", "log_domain", "power_domain", "divide")
# ops whose overflow an exponent drives: "subtract the row max before exp" applies to them
_EXPONENTIALS = {"exp", "exp2", "expm1", "sinh", "cosh", "_softmax", "logsumexp",
                 "linalg_matrix_exp", "matrix_exp"}


def classify(runner: Runner, phase: str, until: tuple[str, int, int] | None = None, *,
             hit: OpHit | None = None, micro_batch: int = 0, node: str | None = None,
             saved: str | None = None, at_pole: str | None = None,
             underflowed: bool = False, inner: str | None = None,
             dtype: torch.dtype | None = None, edge: torch.Tensor | None = None) -> Cause:
    """The cause of a forward, loss or backward origin. ``until``, for a forward origin, is its
    ``(module, call, micro-batch)``: the float64 forward stops after that call, as what comes
    later (made from the origin's value, or another problem) cannot say what the origin's
    value was. ``hit`` is the op blamed (its call is found again in the float64 re-run, in that
    module call or, for a loss origin, in the loss of ``micro_batch``); ``node`` the backward
    node, ``saved`` the kind of a non-finite value it saved in the forward, ``at_pole``
    ``"0"`` when it saved an exact 0, ``"subnormal"`` a value below its type's smallest normal
    number, ``underflowed`` whether an input of it came from exp, softmax or sigmoid (a 0 there
    underflowed), ``inner`` the aten op that made the value inside a custom autograd.Function's
    backward (its derivative's poles are that op's), ``dtype`` that of the node's non-finite
    gradient (else the micro-batch's narrowest), ``edge`` the input it saved at +-1 (its
    float64 counterpart's distance to the edge: replay.exact_edge)."""
    # (a backward ``hit``: an op of a gradient hook, whose occurrence is counted in the hook)
    # (also without evidence: a model raising after the op, on its NaN, is answered by it)
    capture = OpAt(hit.op, hit.occurrence) if hit is not None and phase != "backward" else None
    if hit is not None and (unwritten := uninitialised.hint(hit)):  # (no arithmetic made it)
        return Cause("invalid", unwritten)
    try:
        still = float64_still(runner, phase, until, capture, micro_batch)
    except Exception as e:  # the model refuses float64 (a kernel for half types only)
        ev = hit.evidence if hit is not None else None
        if ev is not None and ev.local64 is not None and bool(torch.isfinite(ev.local64).all()):
            return _beyond_type(hit.op, ev)  # (the op alone in float64 says it)
        return Cause(None, no_float64(e))
    if hit is not None and hit.literal is not None and hit.made == "nan" and hit.inputs_finite \
            and not hit.intentional:  # (also a hook's in backward: a reversal's NaN lambda)
        return _from_literal(hit)
    if phase == "backward" and hit is not None and hit.evidence is not None:
        found = _from_evidence(hit, None, still)  # its values say it, as a forward op's do
        return Cause(found.name, found.hint + upstream.context(found.name, hit.evidence, None))
    if phase == "backward":
        return _backward(node, still, dtype or _step_dtype(runner, micro_batch), saved,
                         at_pole, underflowed, inner,
                         lambda: exact_edge.exact_gap(runner, node, edge))
    if hit is not None and hit.intentional and phase == "forward":
        # the only non-finite value is a literal fill (a mask) reaching the module's output:
        # no op overflowed or left its domain, so the generic domain advice would mislead
        if hit.made == "nan":  # (a NaN fill meant for nanmean, reaching another reduction)
            return Cause("invalid", f"{hit.op} filled a literal NaN on purpose, and it reached "
                         "the output: " + DO["nan_fill"])
        made = (f"passed on the {label(hit.made)} of buffer '{hit.buffer}'" if hit.buffer
                else f"filled a literal {label(hit.made)}")
        return Cause("invalid", f"{hit.op} {made} on purpose (a mask), and it reached the "
                     "output, where by default an infinity is an event; no op overflowed or "
                     "left its domain: " + DO["literal_inf"])
    if hit is None or hit.intentional or (hit.evidence is None and hit.inputs_finite):
        return (Cause("invalid", HINTS["loss" if phase == "loss" else "invalid"]) if still
                else Cause("overflow", "the value is finite in float64: "
                           + _wider(_step_dtype(runner, micro_batch))))
    if hit.evidence is None:
        return _from_infinities(hit) if still else \
            _overflow_among_infinities(hit, _step_dtype(runner, micro_batch))
    found = _from_evidence(hit, capture, still)  # (what the ops before it add, see upstream)
    return Cause(found.name, found.hint + upstream.context(
        found.name, hit.evidence, _autocast(runner, micro_batch, phase)))


# deciding from the evidence ---------------------------------------------------------------


def _advice(situation: str) -> str:
    """What to do where rounding crossed the domain edge of ``situation`` (a DO key)."""
    return DO[situation if situation in _OWN_ADVICE else "stable"]


def _in_type_hint(name: str, what: str, dt: str, ev: Evidence) -> str | None:
    """A rounded input's own hint: a saturated complement's, 1 - x² of a cosine past ±1."""
    return saturation.in_type_hint(name, what, dt, ev) or unit_forward_hint(what, ev)


def _rounded_hint(name: str, what: str, ev: Evidence, capture: OpAt | None) -> str | None:
    """The hint of an input that float64 rounds past the edge too: a saturated complement, or
    a cancelled difference (``capture``: the float64 re-run's op, which tells its source)."""
    return saturation.rounded_hint(name, what, ev) or cancellation.rounded_hint(
        name, what, ev, capture)


def _from_evidence(hit: OpHit, capture: OpAt | None, still: bool) -> Cause:
    ev = hit.evidence  # (a custom op's: that of the op in its kernel that made it, own_ops)
    op = hit.inner.op if hit.inner is not None and hit.inner.evidence is ev else hit.op
    name = _name(op)
    dt = _type(ev.dtype)
    if ev.local64 is not None and bool(torch.isfinite(ev.local64).all()):
        own = domains.own_factor_sign(op, ev)  # (its own rounding, not an overflow)
        return Cause("precision", f"{own}: " + DO["log_det"]) if own else _beyond_type(op, ev)
    if domains.no_pole(name, ev):
        if name in INNER_EXP:  # (its true result fits; its exp does not: a stable form does)
            return Cause("overflow", f"{op} overflowed: " + log_advice(op, ""))
        if ev.local64 is None and not still:  # a random op: the float64 step decides
            return Cause("overflow", f"{op}'s result is too large for {dt} and finite in "
                         "float64: " + _wider(ev.dtype))
        also = "" if ev.dtype == torch.float64 else BEYOND_FLOAT64
        exp = name.rstrip("_") in _EXPONENTIALS or _exp_factor(ev)
        return Cause("overflow", f"{op}'s true result is too large for {dt}{also}: "
                     + log_advice(op, DO["clamp_exp" if exp else "clamp"]))
    what, situation = domains.describe(name, ev)
    zero_from_exp = [i for i, v in enumerate(ev.inputs)
                     if ev.exp_made[i] and ev.elementwise[i] and bool((v == 0).any())]
    rounded = _float64_op_finite(capture, ev)
    moved = float64_inputs.moved(capture, ev) if rounded else None
    if moved is not None and moved[0] == "underflow":
        return _underflow(name, what, ev, moved)
    if zero_from_exp:  # (or from a square of a non-zero value: re² + im²)
        src, fix = zero_source(ev, zero_from_exp, _POSITIVE_OPS, DO["log_space"], name)
        also = "" if rounded else BELOW_FLOAT64
        return Cause("underflow", f"{what}: that 0 came from {src}; it underflowed in "
                     f"{_type(ev.input_dtypes[zero_from_exp[0]])}{also}: " + fix)
    if rounded or (rounded is None and not still):
        if rounded is None and any(bool((v == 0).any()) for v in ev.inputs):
            return Cause("underflow", f"{what}: float64 keeps the step finite, so that 0 is "
                         "a value rounded to 0: " + DO["log_space"])
        if rounded and (left := residue.hint(name, capture, ev, what, DO[situation])):
            return Cause("invalid", left)  # float64's divisor: its own rounding of a 0
        seen = (f" (float64 has {domains.g_apart(moved[2], *domains.given(ev, moved[1]))}"
                " there)" if moved else "")  # (digits enough not to read as the value given)
        how = ("" if situation in _OWN_ADVICE or lost_eps.context(ev) else  # (an eps, lost)
               " (catastrophic cancellation, as in a variance E[x²] − E[x]²)")
        return Cause("precision", _in_type_hint(name, what + seen, dt, ev)
                     or rounded_column.hint(situation, what + seen, dt, ev) or (
            f"{what}{seen}: no value left {dt}'s range, but rounding pushed the input across the "
            f"domain edge, which exact arithmetic does not cross{how}" + lost_eps.unless_bound(
                ev, ": " + _advice(situation) + root_floor.advice(name, moved)
                + half_clamp.advice(situation, ev.dtype))))
    if said := _rounded_hint(name, what, ev, capture):
        return Cause("precision", said)
    past = rounded_past_edge(name, ev, capture) if rounded is False else None
    if past is not None:
        return Cause("precision", f"{what}: float64 is past the edge too, but by "
                     f"{domains.g_apart(past[1], 0.0)} against {dt}'s {_g(past[0])}: the "
                     "margin shrank with the type's precision, so rounding put the input "
                     "there, which exact arithmetic does not: " + _advice(situation))
    if (ev.of_data or ev.of_weights) and situation in _OF_RECORDS and not lost_eps.zero(ev):
        if ev.counts:  # (a count of 0 is a record, not a degenerate one)
            return Cause("invalid", f"{what}, which exact arithmetic makes too: " + ev.counts)
        situation = ("compared" if ev.compared else "of_data") if ev.of_data else "of_weights"
    return Cause("invalid", f"{what}, which exact arithmetic makes too: " + DO[situation])


def _underflow(name: str, what: str, ev: Evidence, moved) -> Cause:
    """An input 0 in the step that float64 holds below the smallest value of a type it went
    through (``replay.float64_inputs``)."""
    _, i, w = moved
    it = next(t for t in float64_inputs.made_in(ev, i)  # (its own type first, as before)
              if abs(w) < float64_inputs.smallest(t, t != ev.input_dtypes[i]))
    own = it == ev.input_dtypes[i]
    edge = "smallest normal" if own else "smallest subnormal"
    before = "" if own else f" (ops before it computed in {_type(it)})"
    # a half type's underflow that float32 holds, if only as a subnormal (bfloat16's 1e-42,
    # which float32 keeps as such): float32 from where it is made fixes it
    half, held = torch.finfo(it).bits < 32, abs(w) >= float64_inputs.smallest(torch.float32, True)
    wider = DO["wider_under"] + "; or " if half and held else ""
    how = "" if lost_eps.rounded_guard(ev, i, w) else ": " + wider + advice(name, ev, i)
    return Cause("underflow", f"{what}: that input is {_g(w)} in float64, below "
                 f"{_type(it)}'s {edge} number {_g(float64_inputs.smallest(it, not own))}"
                 f"{before}, and was rounded to 0{BELOW_FLOAT32 if half and not held else ''}" + how)


def _beyond_type(op: str, ev: Evidence) -> Cause:
    """An op whose float64 result is finite where its own is not: too large for its type."""
    dt = _type(ev.dtype)
    if (literal := unheld_literal(ev)) is not None:  # (-1e9 for a mask, under float16)
        return Cause("overflow", literal_hint(op, literal, ev.dtype))
    if fill := fill_hint(op, ev):  # (-finfo.max a fully masked row kept, summed or squared)
        return Cause("overflow", fill)
    big = float(ev.local64.abs().max()) if ev.local64.numel() else math.inf
    big_s, top_s = domains.g_pair(big, top := torch.finfo(ev.dtype).max)
    if big <= top:  # the result fits: a value the op made on the way did not (a sum of
        # squares before the mean, as mse_loss and norms take), so say that, not "beyond"
        return Cause("overflow", f"{op}'s true result (up to {big_s}) fits in {dt}, but a value "
                     f"it computes on the way (a sum or product before its result) is beyond "
                     f"{dt}'s largest value {top_s}; float64 holds it: " + _wider(ev.dtype))
    return Cause("overflow", f"{op}'s true result (up to {big_s}) is finite but beyond "
                 f"{dt}'s largest value {top_s}; float64 holds it: "
                 + log_advice(op, _wider(ev.dtype, op, ev)))


def _float64_op_finite(capture: OpAt | None, ev: Evidence) -> bool | None:
    """Whether the blamed op's call, in the float64 re-run, is finite where it was not; None
    when that call was not found again (another op sequence)."""
    if capture is None or capture.outputs is None or ev.output >= len(capture.outputs):
        return None
    out = capture.outputs[ev.output]
    if out.shape != ev.bad.shape:
        return None
    return bool(torch.isfinite(out[ev.bad.to(out.device)]).all())


# ops over a row that make NaN or -inf of a row whose entries are all -inf (a mask)
_ROW_REDUCTIONS = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax",
                   "logsumexp", "amax", "max"}


def _from_infinities(hit: OpHit) -> Cause:
    """The op made NaN from infinities it was given (a -inf mask, an earlier overflow that the
    chain shows)."""
    name = _name(hit.op).rstrip("_")
    if name in _ROW_REDUCTIONS:  # softmax: NaN; logsumexp, amax: -inf (OpFinder.first_reduced)
        return Cause("invalid", row_hint(hit, name))  # (or of a +inf it held)
    if name in GROUP_REDUCTIONS:  # OpFinder.first_reduced: the fill it started from
        return Cause("invalid", f"{hit.op} left the {hit.made} it started from in the rows no "
                     "element was reduced into (an empty group: a graph without nodes): "
                     + DO["empty_group"])
    if hit.made != "nan":  # OpFinder.first_reduced: an infinity it was given, summed in
        if forbidden := forbidden_target_hint(name, hit.made) or folded_pick_hint(hit) \
                or selected_fill_hint(name, hit):
            return Cause("invalid", forbidden)
        return Cause("invalid", f"{hit.op} folded an infinity it was given into {hit.made} "
                     "(one held on purpose, such as a -inf mask under allow_inf: a "
                     "log-probability of exactly 0, infinite in exact arithmetic too): "
                     + DO["inf_weight"])
    what = INF_ARITH.get(name, "NaN from infinities")
    if hit.from_mask and name in MASK_ARITH:  # the only infinities were put in on purpose
        given, do = empty_rows.advice(hit) or MASK_ARITH[name]
        return Cause("invalid", f"{hit.op} computed {what}, NaN in exact arithmetic too, "
                     f"from {given} put in on purpose (a mask: the chain's start, or the "
                     f"model output's, which allow_inf lets hold it){do}")
    return Cause("invalid", f"{hit.op} computed {what}, NaN in exact arithmetic too: "
                 + DO["inf_arith"])


def _from_literal(hit: OpHit) -> Cause:
    """The op made NaN from finite tensors and an infinity written as a number: a mask built by
    arithmetic (``(1 - keep) * float("-inf")`` is ``0 * -inf`` where ``keep`` is 1)."""
    if math.isnan(hit.literal):  # (a NaN number: Python's or numpy's, not the op's)
        return Cause("invalid", nan_number_hint(hit.op))
    what = inf_arith(hit.op, "NaN from the infinity")
    return Cause("invalid", f"{hit.op} computed {what} with the literal {hit.literal:+} it "
                 "was given as a number, NaN in exact arithmetic too: " + DO["inf_literal"])


def _overflow_among_infinities(hit: OpHit, dtype: torch.dtype) -> Cause:
    """NaN beside infinities in the inputs (a -inf mask), yet finite in float64: a value
    computed on the way overflowed (attention scores of exploded weights), not the mask."""
    return Cause("overflow", f"{hit.op} made NaN where its inputs held infinities (a -inf "
                 "mask, which exact arithmetic handles), yet its call is finite in float64: "
                 f"a value it computes on the way overflowed {_type(dtype)}: "
                 + _wider(dtype, hit.op))
