"""A forward op at its pole whose operand there is the batch's own data, as given.

Log returns ``log(p[:, 1:] / p[:, :-1])`` of a price table with a 0 in it (a missing print
filled with 0, a forward fill from a leading 0): the divisor is a view of the model's input,
nothing computed from it, and its 0 is a value of the record. The usual advice for a 0/0, an
eps on the divisor (``std + eps``), is for a statistic the code computed (a constant row's
std); on a raw value it turns the bad record into a huge finite ratio the model trains on.
:class:`RawPole` watches the ops of the origin's module call (fed by
:class:`~replay.lineage.Lineage`) for the first pole op whose operand at the pole shares its
storage with a tensor of the batch, unmodified since, or is such a value's product or
quotient with data (``p_t / p_{t-1}``, 0 where a delisted ``p_t`` is 0, before the log), or
its product with a learned factor (a nominal capacity of 0 times a learned fade), and holds a 0 where the op went non-finite; :func:`raw_pole_hint` then points at the record.
A norm of the batch's records (DAGMM's relative distance ``|x - x'| / |x|``; a record's power
``10 log10(x.pow(2).mean((1, 2)))``, one per record) is 0 exactly for an all-zero record (a
norm of part of each, a noise power from a guard band's bins, for an all-zero part: a
noise-free frame's): a divisor made so points at blank records (or parts); a difference of
two of its values (a rate ``diff(I) / diff(t)``) is 0 where the record repeats one: a
duplicated row. A 0-d tensor given with the batch (the Hugging Face Trainer's
``num_items_in_batch``, the step's count of labels that are not -100) is no record's value: its
0 is a count of nothing, said as such (the records' advice named samples there are none of).
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import zero_one

from .compat import version
from .legal_zero import legal_zero, legal_zero_text
from .memo import TensorMarks, TensorSet
from .padded_zeros import padded_hint, padding_mask, padding_masks

# ops with a pole at an operand of 0, and which operand that is
_POLE_OPERAND = {"div": 1, "reciprocal": 0, "log": 0, "log2": 0, "log10": 0, "rsqrt": 0}
# ops whose 0 is a 0 of their first argument's (or, for mul, either's), as the record's 0
_CARRY_ZERO = {"mul": 2, "div": 1}
# reductions 0 exactly where every value they reduce is 0: a record's norm, 0 for a blank one;
# a sum or mean is one of values >= 0 over each whole record (a frame's ``mean(|x| ** 2)``)
_NORMS = {"linalg_vector_norm", "norm", "frobenius_norm"}
_NONNEG_SUMS = {"sum", "mean"}
# ops making a complex value of their first N arguments, 0 exactly where all of those are 0:
# an impedance ``torch.complex(r, x)``, a phasor ``torch.polar(mag, angle)``
_COMPLEX_MAKERS = {"complex": 2, "polar": 1}
# ops that keep the values of their first argument as they are
_SAME_VALUES = {"slice", "select", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze",
                "permute", "transpose", "t", "expand", "clone", "contiguous", "alias"}

# the pole's operand is a 0-d tensor given with the batch: a number of the batch, no record's
SCALAR = (
    "{op} {what} is a number given with the batch ({held}a 0-d tensor, the model's input as "
    "given: no sample's value), exactly 0: a count or total the loop computed over the batch "
    "(the Hugging Face Trainer's num_items_in_batch counts the step's labels that are not "
    "-100, summed over its micro-batches) whose batch holds none of what it counts; find why "
    "the batch has none, and skip a step whose count is 0 (or divide by count.clamp_min(1))")


class RawPole:
    """The batch's floating tensors (``(args, kwargs)`` of the root call) and the first pole
    op (``aten.NAME``) that went non-finite at a 0 of one of them, as given."""

    def __init__(self, batch: Any):
        self._storages = {t.untyped_storage().data_ptr(): version(t)
                          for t in tensor_leaves(batch) if _strided_float(t)}
        self._names = _input_names(batch)  # storage: the root call's argument holding it
        self._masks = padding_masks(_named_inputs(batch))  # 0/1 tensors: padding masks?
        self.padding: str | None = None  # the mask whose 0s are the pole's 0s (padding)
        self._named = TensorMarks()  # a carried value: the argument its 0s are the 0s of
        self.input: str | None = None  # the argument the pole's operand came from
        self.op: str | None = None
        self.blank = False  # the pole's operand is a norm of the records: all-zero ones
        self._carried = TensorSet()  # values whose 0s are the batch's own 0s
        self._normed = TensorSet()  # those that are norms of the batch's records
        self._diffed = TensorSet()  # and differences of two of their values (torch.diff)
        self._squared = TensorSet()  # the batch's magnitudes or powers >= 0: 0 where it is
        self._part = TensorSet()  # values of part of each record (a band sliced out of it)
        self._summed = TensorSet()  # norms made by a sum or mean of them (mean(x ** 2))
        self.part = False  # the pole's operand is a norm of such a part
        self.diffed = False  # the pole's operand is such a difference
        self.complex = False  # the pole's operand is a complex number made of the batch's
        self.scalar = False  # the pole's operand is one number given with the batch (0-d)
        self.legal = None  # the spread of the other samples' values, when it holds 0

    def _raw(self, x) -> bool:
        # (a view of the batch's storage at the version it was given: no in-place op since)
        return (_strided_float(x) or _complex_carried(x, self._carried)) and (
            x in self._carried or not x.requires_grad and
                                      self._storages.get(x.untyped_storage().data_ptr())
                                      == version(x))

    def _name_of(self, x) -> str | None:
        return self._named.get(x) or self._names.get(x.untyped_storage().data_ptr())

    def _carry(self, out, args) -> None:
        self._carried.add(out)
        raws = [a for a in args if isinstance(a, torch.Tensor) and self._raw(a)]
        # (of a product of two records, the one holding a 0)
        source = next((a for a in raws if bool((a == 0).any())), raws[0] if raws else None)
        if source is not None and (named := self._name_of(source)) is not None:
            self._named.put(out, named)

    def track(self, name: str, args, out) -> None:
        name = name.split(".")[0]
        if self.op is not None or not isinstance(out, torch.Tensor) or not args:
            return
        if name in _SAME_VALUES and self._raw(args[0]) and (args[0] in self._part or (
                out.dim() and args[0].dim() and out.shape[0] == args[0].shape[0]
                and out.numel() < args[0].numel())):
            self._part.add(out)  # (each sample's rows kept, some of its values dropped)
        if _nonneg_power(name, args) and args[0] in self._part:
            self._part.add(out)
        if name in _COMPLEX_MAKERS and out.is_complex() and all(
                isinstance(a, torch.Tensor) and self._raw(a) and not a.requires_grad
                for a in args[:_COMPLEX_MAKERS[name]]):
            self._carry(out, args[:_COMPLEX_MAKERS[name]])  # (r + jx of a record's r, x)
        if (name in _SAME_VALUES and self._raw(args[0])) or (
                name in _CARRY_ZERO and any(self._raw(a) for a in args[:_CARRY_ZERO[name]])
                and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)) \
                or (name == "mul" and any(_data_factor(self._raw, a) for a in args[:2])):
            self._carry(out, args)
        if name == "sub" and len(args) > 1 and self._raw(args[0]) and self._raw(args[1]) \
                and not args[0].requires_grad and not args[1].requires_grad:
            self._carry(out, args)  # (a difference of two of the record's values: 0 if equal)
            self._diffed.add(out)
        if _nonneg_power(name, args) and self._raw(args[0]) and not args[0].requires_grad:
            # (not carried itself: a log of a frame's power of silence wants its floor, eps)
            self._squared.add(out)
            if (named := self._name_of(args[0])) is not None:
                self._named.put(out, named)
        if (name in _NORMS and self._raw(args[0])) or (
                name in _NONNEG_SUMS and args[0] in self._squared
                and out.numel() == args[0].shape[0]):  # (one per record: the whole record's)
            self._carry(out, args)
            if args[0] in self._squared and (named := self._named.get(args[0])) is not None:
                self._named.put(out, named)
            self._normed.add(out)
            if args[0] in self._part:
                self._part.add(out)
            if name in _NONNEG_SUMS:
                self._summed.add(out)
        at = _POLE_OPERAND.get(name)
        if at is None or len(args) <= at or not self._raw(x := args[at]):
            return
        try:
            at_zero = (x == 0) & ~torch.isfinite(out)
        except RuntimeError:  # (shapes that do not broadcast to the output: not elementwise)
            return
        if bool(at_zero.any()) and not (
                name == "div" and x in self._summed and _zero_by_zero(args[0], at_zero)):
            self.op, self.blank, self.diffed = f"aten.{name}", x in self._normed, x in self._diffed
            # (a 0-d norm of one record, torchvision's list of images, is a record's own)
            self.complex, self.scalar = x.is_complex(), x.dim() == 0 and x not in self._normed
            self.input, self.part = self._name_of(x), x in self._part
            self.padding = padding_mask(at_zero, self._masks)
            self.legal = legal_zero(x, at_zero)  # (samples along dim 0: a t ~ U[0, 1] at 0)


def raw_pole_hint(watch: RawPole | None, cause: str | None, hit) -> str | None:
    """The hint for ``hit``, an ``invalid`` forward op that ``watch`` saw at a 0 of the
    batch's own values; else None."""
    if watch is None or cause != "invalid" or hit is None or watch.op != hit.op:
        return None
    what = "by 0: its divisor" if hit.op == "aten.div" else "of 0: its input"
    if watch.padding:  # (a padded set's elements, 0 by the collate_fn: no record is bad)
        return padded_hint(hit.op, what, watch.padding)
    held = f"{watch.input}: " if watch.input else ""
    if watch.scalar:
        return SCALAR.format(op=hit.op, what=what, held=held)
    if watch.blank and watch.part:
        return (f"{hit.op} {what} is a norm of part of the batch's own records ({held}the "
                "model's input as given, some of each record's values), exactly 0 in the "
                "samples named: the values it reads of them are all zeros (a noise-only "
                "band of a noise-free simulation, a channel or segment never filled); floor "
                "it at a level the data can have (a noise floor: clamp_min), bound what it "
                "makes (clamp the ratio to the range the model trains on), or leave such "
                "records out")
    if watch.blank:
        return (f"{hit.op} {what} is a norm of the batch's own records ({held}the model's "
                "input as given), exactly 0 in the samples named: those records are all "
                "zeros (a blank or empty record: a missing row filled with 0, a padding row, "
                "an empty capture); drop or repair them where the data is made, or give them "
                "a value of their own (torch.where(norm > 0, ratio, 0)). An eps on the norm "
                "hides them only where the numerator is 0 too (F.normalize's x / max(|x|, "
                "eps)); elsewhere it makes a huge finite ratio the model trains on")
    if watch.diffed:
        return (f"{hit.op} {what} is a difference of two of the batch's own values ({held}"
                "the model's input as given: torch.diff of timestamps, x2 - x1 of a box), "
                "exactly 0 in the samples named, where the record repeats a value (a "
                "timestamp logged twice, two rows in one clock tick; a box of zero width): "
                "drop or merge such rows where the data is made, or floor the difference at "
                "the resolution the data has (dt.clamp_min(min_dt)). An eps on it would make a "
                "huge finite rate the model trains on")
    if watch.legal is not None and not watch.complex:
        return (f"{hit.op} {what} is the batch's own data ({held}the model's input as given), "
                "exactly 0 in the samples named; " + legal_zero_text(watch.input or "it",
                                                                     watch.legal)
                + "; --try drop= with those samples re-runs the step without them, a check "
                "that nothing else in them is wrong")
    made = ("; here a complex number made of it and other data, torch.complex(re, im), 0 "
            "where both parts are: an impedance r + jx of 0 is a zero-impedance branch (a "
            "closed switch or bus coupler, whose two ends are one node: merge them where the "
            "network is built, or give the branch the impedance it has)"
            if watch.complex else "")
    return (f"{hit.op} {what} is the batch's own data ({held}the model's input as given, or "
            f"its ratio or product with other data or a learned factor{made}), exactly 0 in "
            "the samples named: a 0 where the data should hold none (a missing value filled with 0: a "
            "price, volume or count of 0, a capacity missing from a record's metadata, a "
            "forward fill from a leading 0, an instrument not yet listed; a sensor's nodata "
            "fill, a pixel outside the swath) is a bad record; repair it where the data "
            "is made (fill from the last valid value, drop or mask the sample, or mask its "
            "nodata entries out of the op and the loss), or, if 0 is a valid value there, do "
            "not take the op at it (torch.where(x != 0, ...); log1p for a log of counts). An "
            "eps on it would turn the record into a huge finite value the model trains on")


def _named_inputs(given: Any) -> dict[str, torch.Tensor]:
    """The root call's top-level tensor arguments, by the name the report gives them."""
    if not (isinstance(given, tuple) and len(given) == 2):
        return {}
    args, kwargs = given
    named = {("batch" if len(args) == 1 else f"args[{i}]"): a for i, a in enumerate(args)}
    named.update({f'kwargs["{k}"]': v for k, v in (kwargs or {}).items()})
    return {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}


def _input_names(given: Any) -> dict[int, str]:
    """The storage of each floating tensor of the root call's ``(args, kwargs)``: the name of
    the argument holding it, as the report names inputs (``args[2]``, ``kwargs["mask"]``)."""
    if not (isinstance(given, tuple) and len(given) == 2):
        return {}
    args, kwargs = given
    tops = [("batch" if len(args) == 1 else f"args[{i}]", a) for i, a in enumerate(args)]
    tops += [(f'kwargs["{k}"]', v) for k, v in (kwargs or {}).items()]
    names: dict[int, str] = {}
    for top, value in tops:
        for t in tensor_leaves(value):
            if _strided_float(t):
                names.setdefault(t.untyped_storage().data_ptr(), top)
    return names


def _zero_by_zero(num, at: torch.Tensor) -> bool:
    """A division's numerator ``num`` is 0 wherever it is non-finite at its divisor's 0: a
    mean scaling's ``x / mean(|x|)`` of an all-zero series, which an eps (DeepAR's
    ``1 + mean``) scales to the 0 it is, so the plain 0/0 advice holds."""
    try:
        return isinstance(num, torch.Tensor) and bool(
            torch.broadcast_to(num == 0, at.shape)[at].all())
    except RuntimeError:  # (not elementwise with the output)
        return False


def _complex_carried(t, carried: TensorSet) -> bool:
    """``t`` is a dense complex value made of the batch's own values (``_COMPLEX_MAKERS``)."""
    return isinstance(t, torch.Tensor) and t.is_complex() and t.layout == torch.strided \
        and t in carried


def _nonneg_power(name: str, args) -> bool:
    """Op ``name`` on ``args`` makes values >= 0 that are 0 exactly where its input is: ``abs``,
    a square, an even power."""
    if name in ("abs", "square"):
        return True
    p = args[1] if name == "pow" and len(args) > 1 else None
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0 and p % 2 == 0


def _strided_float(t) -> bool:
    """A dense floating tensor (a sparse adjacency or a nested tensor has no storage to key)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided \
        and not t.is_nested


def _data_factor(raw, a) -> bool:
    """``a`` is the batch's own values, not a 0/1 mask: a product with a learned factor keeps
    its 0s as the record's (a cell's nominal capacity, 0 where its metadata is missing, times
    a learned fade ``q_nom * (1 - a N^z)``), while a mask's 0 there is masking, said elsewhere."""
    return raw(a) and not a.requires_grad and not zero_one(a)
