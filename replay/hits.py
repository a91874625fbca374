"""What the op finder (:mod:`replay.ops`) keeps of the op it blames: the hit (which op, where,
what it made) and the evidence (its values where its output went non-finite), which
:mod:`replay.cause` reads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .source import library_caller


@dataclass
class OpHit:
    op: str  # e.g. "aten.log"
    made: str  # "nan", "+inf", "-inf"
    source: str | None  # "model.py:42"
    input_min: float | None
    input_max: float | None
    intentional: bool = False
    occurrence: int = 0  # how many calls of this op came before it in the watched code
    inputs_finite: bool = False  # else it made NaN from infinities (inf - inf)
    evidence: Evidence | None = None  # what the cause needs, taken while the op's values live
    rows: list[int] | None = None  # non-finite samples of its output (OpFinder(samples=...))
    param: str | None = None  # a model parameter it took as an input, as is (OpFinder.params)
    buffer: str | None = None  # the model buffer whose +-inf (a mask) it passed on, if any
    literal: float | None = None  # a +-inf it was given as a number (``m * float("-inf")``)
    # the innermost module call running it, (name, call) in its micro-batch (OpFinder.where)
    within: tuple[str, int] | None = None
    # the autograd node running it: a derivative the forward took itself (autograd.grad of
    # a Hamiltonian, an energy), whose pole is the input of the forward op that made the node
    node: Any = None
    seq: int = 0  # how many ops of any kind came before it in the watched code
    from_mask: bool = False  # made NaN when only intended infinities (a mask) had been made
    row_masked: bool = False  # and an operand's whole row was -inf there (replay.empty_rows)
    # (its output's dim 0 size, the non-finite indices there) when it named no sample: an
    # input of its own size beside the batch (replay.other_rows)
    lead_rows: tuple[int, list[int]] | None = None
    # a reduction's non-finite places over its output's first two dims (it has no evidence):
    # a MaxSim's (queries, passages) of passages with no token left (replay.other_rows)
    grid: Any = None
    # a reduction's: the index op that read the intended fill's infinity it folded in, before
    # it (a lattice's unreachable final cell: replay.picked_fill)
    picked: OpHit | None = None
    # where ``source`` is an installed package's line (Pyro's ``kl.py``, GPyTorch's kernel), the
    # line of the model's or loss's own code that called into that package (with_caller)
    called_from: str | None = None
    # a custom op's (torch.library.custom_op): the op inside its Python kernel that made the
    # value (replay.own_ops)
    inner: OpHit | None = None
    # an allocation's (torch.empty): its entries still unwritten when read (replay.uninitialised)
    unwritten: str | None = None

    def as_json(self) -> dict[str, Any]:
        # (its dtype: the type an overflow of its output beat, which can be another than the
        # origin's, a float16 mm under autocast whose infinity a float32 loss took)
        dtype = {} if self.evidence is None else {
            "dtype": str(self.evidence.dtype).removeprefix("torch.")}
        return {"op": self.op, "made": self.made, "source": self.source,
                "input_min": _num(self.input_min), "input_max": _num(self.input_max),
                "intentional": self.intentional, **dtype}


@dataclass
class Evidence:
    """The op's values where its first non-finite output is non-finite (``bad``): each
    floating input there (the whole input when it does not broadcast to the output), in
    float64, and the op computed again in float64 on those very inputs (``local64``: None for
    a random op). :mod:`replay.cause` reads it; nothing here decides the cause."""

    dtype: torch.dtype  # of the non-finite output
    bad: torch.Tensor  # bool mask over that output
    inputs: list[torch.Tensor]  # float64 values at ``bad`` (or the whole input), per input
    input_dtypes: list[torch.dtype]
    elementwise: list[bool]  # whether inputs[i] is taken at ``bad`` (same positions)
    exp_made: list[bool]  # inputs[i] came from exp/softmax/sigmoid of a finite argument
    # (or is else non-zero in exact arithmetic: replay.nonzero)
    local64: torch.Tensor | None  # the op's float64 result at ``bad`` (same shape as ``bad``)
    others: list[torch.Tensor]  # the op's other outputs (nll_loss's total weight)
    output: int = 0  # which floating output ``bad`` is over
    # a division's divisor made of a parameter by adding a number to it, 0 there: (its name,
    # its value: Barron's ``|alpha - 2|`` at alpha = 2; replay.param_names)
    param_shift: tuple[str, float] | None = None
    empty: bool = False  # a floating input has no element (the mean of nothing is 0/0)
    args: tuple = ()  # positional arguments, floating tensors replaced by None (CTC lengths)
    read: frozenset = frozenset()  # those of its numbers .item() read (replay.read_numbers)
    complement: list[bool] = field(default_factory=list)  # 1 - tanh(u)² (replay.saturation)
    power: list[bool] = field(default_factory=list)  # and of those, sigmoid(z)^-b - 1
    mixed: list[bool] = field(default_factory=list)  # or 1 - (c + (1 - c) s): a 3PL's
    zero_dim: list[bool] = field(default_factory=list)  # inputs[i] was 0-d (events.sum())
    of_data: bool = False  # no input was learned (replay.lineage): made of the data alone
    compared: bool = False  # and the loss compared it with the op's result on a learned value
    counts: str = ""  # and its advice where it took counts, 0 in some rows (replay.data_counts)
    data_divisor: str = ""  # its advice: a learned value over a data divisor (replay.data_divisor)
    data_factor: bool = False  # over a learned value times data 0 there (replay.data_factor)
    cut_divisor: bool = False  # over a divisor a ReLU cut to 0 (replay.clamped_divisor)
    unlearned: bool = False  # no input requires grad, in some samples (replay.batch_overflow)
    of_weights: bool = False  # every input a parameter or buffer, or made of them alone
    made_of: list[str] = field(default_factory=list)  # and those (replay.made_of_params)
    squared: list[bool] = field(default_factory=list)  # exp_made[i] by a square (re² + im²)
    signed: list[bool] = field(default_factory=list)  # exp_made[i] of either sign (nonzero)
    of_exp: list[bool] = field(default_factory=list)  # inputs[i] is exp's own result
    trig: list[bool] = field(default_factory=list)  # a cos or sin result (replay.trig_root)
    chained: list[int] = field(default_factory=list)  # its products (replay.chain_product)
    # a decomposition's values: "cholesky", "eigenvalues" or None each (replay.factors)
    factor: list[str | None] = field(default_factory=list)
    narrowest: torch.dtype | None = None  # the narrowest type an op before it made
    given_in: torch.dtype | None = None  # a loss's: the forward's autocast (float64_inputs)
    sizes: list[float] = field(default_factory=list)  # its earlier finite calls' absmax
    # per input, the eps it was guarded by that its type rounded to 0 (replay.lost_eps)
    lost_eps: list[float | None] = field(default_factory=list)
    terms: list = field(default_factory=list)  # a difference's terms' size (replay.cancellation)
    # the product that multiplied its infinity by a mask's 0, made NaN (replay.masked_product)
    masked_after: str | None = None
    # the product that multiplied a log's -inf by that log's own 0 (p * log p: replay.xlogx)
    own_zero_after: str | None = None
    # and that 0 a target's, the -inf a prediction's log (a BCE written out: "target") or
    # either that or the target's own log (a KL term: "either"; see replay.xlogx)
    target_zero: str | None = None
    # a matrix product's square inputs' spectral radii (replay.operator_power)
    radii: list = field(default_factory=list)
    # a positive op's result plus a number, per input (replay.shifted_positive)
    shifted: list[str | None] = field(default_factory=list)
    # the op that made it positive in exact arithmetic, per input (replay.positive_maker)
    positive_by: list[str | None] = field(default_factory=list)
    # exp of a model parameter (name, lowest value) per input (replay.exp_param)
    exp_param: list = field(default_factory=list)
    # a pole's 0 that a matrix product's all-0 column or row made (replay.zero_operand)
    zero_operand: str | None = None
    # its first input's 1 - x² entries of an x past ±1 (replay.unit_complement)
    unit_square: int = 0


# ops with a pole at an input of 0, where a 0 they are given makes an infinity
_POLES = {"log", "log2", "log10", "div", "reciprocal", "rsqrt", "pow"}


def exact_pole(hit: OpHit) -> bool:
    """``hit`` made +-inf at its pole from inputs float64 puts there too, none of them a
    positive value that underflowed: the log of a weight of exactly 0, an infinity exact
    arithmetic makes (and exp takes back to exactly 0)."""
    ev = hit.evidence
    if ev is None or hit.made == "nan" or hit.op.removeprefix("aten.").rstrip("_") not in _POLES:
        return False
    return ev.local64 is not None and ev.local64.numel() > 0 and not bool(
        torch.isfinite(ev.local64).any()) and not any(ev.exp_made)


def _num(x: float | None):
    if x is None:
        return None
    return x if math.isfinite(x) else repr(x)


def with_caller(hit: OpHit) -> OpHit:
    """``hit`` with :attr:`OpHit.called_from` set, read off the live stack: called while the op
    it names is still running (the op finder's dispatch). None where its source is no
    installed package's, or where no code of the model or loss lies between (a Hugging Face
    model the factory returns as it is: the replay itself called into the package)."""
    hit.called_from = library_caller(hit.source)
    return hit


def hit_sources(hit: OpHit | None) -> dict[str, Any]:
    """An origin's ``source`` from ``hit``, and its ``called_from`` where there is one."""
    out: dict[str, Any] = {"source": hit.source if hit else None}
    if hit is not None and hit.called_from and hit.called_from != hit.source:
        out["called_from"] = hit.called_from
    return out
