"""Complements of saturating functions: values that exact arithmetic keeps above 0 however
large the argument, which rounding makes exactly 0.

tanh, sigmoid and erf of a finite argument lie strictly inside (-1, 1), and so do their
powers and products, and a normal cdf, ``0.5 * (1 + erf(x))``; ``1 - y`` and ``1 + y`` of such a ``y`` are then strictly positive. But
tanh(u) is 1.0 in float32 from u ≈ 9 (in float64 from u ≈ 19), so ``log(1 - tanh(u)²)`` — a
tanh-squashed Gaussian policy's log-probability correction, written without its eps — is
log(0) in both types, while its exact value is about 2 log 2 - 2|u|. Float64 hitting the pole
too does not make that ``invalid``: rounding put the input there, ``precision``. A mean of
such values is inside (-1, 1) too: a bit-balance entropy's ``p = (1 + u.mean(0)) / 2`` of tanh
codes, 0 in ``log(p)`` once a bit rounded to -1 in every row.

A sigmoid lies strictly inside (0, 1), so a negative power of it is strictly above 1 and
``y^-b - 1`` strictly above 0: gSASRec's gBCE, ``log(1 / (sigmoid(z)^-beta - 1))``, whose
sigmoid rounds to 1.0 for a confident positive.

A softmax is strictly below 1 too wherever its slice holds two or more entries above -inf
(its -inf entries are exactly 0, and a slice of one entry is exactly 1), even when some are
-inf: relaxed top-k's successive ``softmax(w + log(1 - onehot))`` rounds a clear winner to
1.0, and the next ``log(1 - onehot)`` is log(0).

A mix ``c + (d - c) * s`` of three such values in (0, 1) (``d`` may be 1) lies between ``c`` and
``d``, so inside (0, 1) too: a 3PL's ``c + (1 - c) * sigmoid(a (theta - b))`` with its guessing
``c = sigmoid(logit_c)``, whose ``log(1 - p)`` is log(0) once ``c`` or the sigmoid rounds to 1.

A logistic written out, ``e / (c + e)`` or ``1 / (c + e)`` of ``e = exp(z)`` and a scalar
``c > 0`` (``c >= 1`` for the reciprocal), is a sigmoid too: inside (0, 1) wherever ``e`` is
finite, so a hand-written case-control likelihood's ``log(1 - exp(eta) / (1 + exp(eta)))`` of
a large polygenic score is rounding, not a value outside the domain.
"""

from __future__ import annotations

import torch

from .memo import TensorMarks, TensorSet
from .positive import first_inputs, node_name, node_op

# strictly inside (-1, 1) for every finite argument
UNIT_OPEN = {"tanh", "sigmoid", "special_expit", "erf"}
# unary ops that keep a value strictly inside (-1, 1) (pow: with a positive scalar exponent)
KEEP = {"neg", "abs", "square", "pow", "clone", "_to_copy", "view", "_unsafe_view", "reshape",
        "expand", "slice", "select", "index_select", "gather", "squeeze", "unsqueeze",
        "permute", "transpose", "t", "contiguous", "alias", "detach", "flatten", "unbind",
        "split", "narrow"}

# averages, inside (-1, 1) where what they average is (a hash bit's mean over the batch of
# tanh codes, whose (1 + mean) / 2 is the fraction of +1s a bit-balance entropy takes the log of)
AVERAGES = {"mean"}

# the same on the autograd graph, for a value made before the watched code ran (a model's
# sigmoid hazards, whose log(1 - h) the loss takes): views and selections of one (not pow,
# whose exponent the node does not say)
_UNIT_NODES = {node_name(op) for op in UNIT_OPEN}
_KEEP_NODES = {node_name(op) for op in KEEP if op != "pow"} | {"ReshapeAlias", "Index"}

# nodes joining several values, inside (-1, 1) when every one of them is
_PIECES = {"Stack", "Cat"}
SOFTMAX = {"_softmax", "softmax"}

# what a rounded complement needs instead of an eps
STABLE = ("use the complement's stable form: log(1 - tanh(u)²) = 2·(log 2 − u − softplus(−2u)) "
          "(a tanh-squashed policy's correction), 1 − sigmoid(z) = sigmoid(−z) and "
          "log(1 − sigmoid(z)) = logsigmoid(−z), a normal's log Φ(z) of 0.5·(1 + erf(z/√2)) = "
          "torch.special.log_ndtr(z) and log(1 − Φ(z)) = log_ndtr(−z), log(1 − softmax(w)ᵢ) "
          "= logsumexp of w without wᵢ minus logsumexp(w); or add an eps inside (1 − y² + 1e-6, "
          "(1 − p).clamp_min(1e-20))")


class Saturation:
    """Tensors made in the watched code that exact arithmetic keeps strictly inside (-1, 1),
    and the complements (``1 - y``, ``1 + y``) made from them, kept strictly above 0."""

    def __init__(self):
        self._unit = TensorSet()
        self._complement = TensorSet()
        self._twice_unit = TensorSet()  # 1 + y, 1 - y: strictly inside (0, 2)
        self._positive = TensorSet()  # sigmoid's: strictly inside (0, 1)
        self._above_one = TensorSet()  # a negative power of those
        self._power = TensorSet()  # y^-b - 1: complements (above 0) of those
        self._gap = TensorMarks()  # d - c, 1 - c of a c in (0, 1): marked with c
        self._mix = TensorMarks()  # (d - c) * s, s in (0, 1): marked with c
        self._mixed = TensorSet()  # c + (d - c) * s, and its complements
        self._exp = TensorSet()  # exp(z): 0 or more
        self._exp_sum = TensorMarks()  # c + exp(z), c > 0: marked with exp(z)

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
              leaves: list) -> None:
        """After an op with finite inputs ran: mark its outputs (see the class)."""
        unit = [t in self._unit for t in ins]
        self._track_mix(name, ins, outs)  # (marks beside the others: a gap is a complement)
        if self._track_power(name, ins, outs, leaves) or self._track_ratio(name, ins, outs,
                                                                           leaves):
            return
        if name in UNIT_OPEN or (ins and all(unit) and (
                name in KEEP and _positive_power(name, leaves) or name == "mul"
                and all(abs(v) <= 1 for v in _scalars(leaves)))) or (
                name in AVERAGES and len(ins) == 1 and (unit[0] or made_unit(ins[0].grad_fn))):
            for t in outs:
                self._unit.add(t)
        elif name in ("rsub", "add") and len(ins) == 1 and _one_or_more(leaves) \
                and (unit[0] or made_unit(ins[0].grad_fn)):
            for t in outs:  # 1 - y, 1 + y (a scalar of at least 1)
                self._complement.add(t)
                if ins[0] in self._mixed or made_mix(ins[0].grad_fn):
                    self._mixed.add(t)
                elif name == "rsub" and ins[0] in self._positive and _scalars(leaves)[0] == 1:
                    self._gap.put(t, ins[0])  # 1 - c, a 3PL's
                if _scalars(leaves)[0] == 1:  # (inside (0, 2))
                    self._twice_unit.add(t)
        elif name in ("mul", "div") and len(ins) == 1 and ins[0] in self._twice_unit \
                and _halves(name, leaves):
            for t in outs:  # a normal cdf, 0.5 * (1 + erf(x)), strictly inside (0, 1):
                self._unit.add(t)  # below 1, and above 0 as 1 + y is (M3's log Φ of a BLQ)
                self._complement.add(t)
        elif (name == "add" and len(ins) == 1 and ins[0] in self._complement
              and _non_negative(leaves)) or (name == "mul" and self._scaled(ins, leaves)):
            for t in outs:  # 1 - y + eps, eps >= 0 (0: an eps option set to 0), or scaled by
                self._complement.add(t)  # a positive action_scale: still above 0

    def _track_power(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                     leaves: list) -> bool:
        """sigmoid(z) (inside (0, 1)), its negative power (above 1), and that minus at most 1
        (above 0: a complement); whether the op was one of those."""
        scalars = _scalars(leaves)
        if name in ("sigmoid", "special_expit"):
            marks = [self._positive, self._unit]
        elif name == "pow" and len(ins) == 1 and ins[0] in self._positive \
                and scalars and scalars[0] < 0:
            marks = [self._above_one]
        elif name in ("sub", "add") and len(ins) == 1 and ins[0] in self._above_one \
                and scalars and all(v == 1 for v in scalars[1:]) \
                and (scalars[0] <= 1 if name == "sub" else scalars[0] >= -1):
            marks = [self._complement, self._power]
        else:
            return False
        return _mark(outs, marks)

    def _track_ratio(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                     leaves: list) -> bool:
        """exp(z), c + exp(z) (c > 0), and the logistic ``e / (c + e)`` (its ``e`` the sum's,
        or an exp of the same values) or ``1 / (c + e)`` (c >= 1) made of them: inside (0, 1),
        as sigmoid's; whether the op was one of those."""
        scalars = _scalars(leaves)
        if name == "exp" and len(ins) == 1:
            marks = [self._exp]
        elif name == "add" and len(ins) == 1 and ins[0] in self._exp and scalars \
                and scalars[0] > 0 and all(v == 1 for v in scalars[1:]):
            for t in outs:
                self._exp_sum.put(t, ins[0])
            return True
        elif (name == "div" and len(ins) == 2 and ins[0] in self._exp
              and _same(ins[0], self._exp_sum.get(ins[1]))) or (
                name == "reciprocal" and len(ins) == 1
                and (e := self._exp_sum.get(ins[0])) is not None and _sum_of_one(ins[0], e)):
            marks = [self._positive, self._unit]
        else:
            return False
        return _mark(outs, marks)

    def _track_mix(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """d - c (d in (0, 1] too), (d - c) * s and c + (d - c) * s of c, s in (0, 1): the
        mix (see the module) is inside (0, 1)."""
        if len(ins) != 2:
            return
        a, b = ins
        if name == "sub" and b in self._positive and (a in self._positive or (
                a.is_floating_point() and bool((a == 1).all()))):
            mark, store = self._gap, b
        elif name == "mul" and (c := self._gap.get(a) if b in self._positive
                                else self._gap.get(b) if a in self._positive else None) \
                is not None:
            mark, store = self._mix, c
        elif name == "add" and (self._mix.get(b) is a or self._mix.get(a) is b):
            for t in outs:
                for m in (self._unit, self._positive, self._mixed):
                    m.add(t)
            return
        else:
            return
        for t in outs:
            mark.put(t, store)

    def mixed(self, t: torch.Tensor) -> bool:
        return t in self._mixed and t in self._complement

    def power(self, t: torch.Tensor) -> bool:
        return t in self._power

    def _scaled(self, ins: list[torch.Tensor], leaves: list) -> bool:
        """A product of a complement and factors all above 0 (CleanRL's squash correction
        ``action_scale * (1 - y²)``, a positive buffer): above 0 in exact arithmetic."""
        mine = [t in self._complement for t in ins]
        return any(mine) and all(v > 0 for v in _scalars(leaves)) and all(
            m or (t.is_floating_point() and bool((t > 0).all()) and bool(t.isfinite().all()))
            for t, m in zip(ins, mine))

    def track_softmax(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                      leaves: list) -> None:
        """A softmax, its input finite or not (see the module): below 1 in exact arithmetic
        where every slice along its dim holds two entries above -inf and no NaN or +inf."""
        if name not in SOFTMAX or len(ins) != 1 or not outs:
            return
        dim = next((v for v in leaves[1:] if isinstance(v, int) and not isinstance(v, bool)),
                   None)
        x = ins[0]
        if dim is None or x.dim() == 0 or bool((x.isnan() | (x == float("inf"))).any()):
            return
        if bool(((x > float("-inf")).sum(dim) >= 2).all()):
            self._unit.add(outs[0])

    def mark_unit(self, t: torch.Tensor, mixed: bool = False) -> None:
        """``t`` stands for a value tanh/sigmoid/erf made where no graph says so (a detached
        copy of the model's output); ``mixed``: a mix of such values (:func:`made_mix`)."""
        self._unit.add(t)
        if mixed:
            self._mixed.add(t)

    def complement(self, t: torch.Tensor) -> bool:
        return t in self._complement


def made_unit(fn, depth: int = 8) -> bool:
    """Whether autograd node ``fn`` made its value by tanh, sigmoid or erf (directly, or
    viewed, selected, gathered, negated, or stacked or concatenated from such values alone: a
    rollout's actions, one tanh per step): strictly inside (-1, 1) in exact arithmetic."""
    try:
        if made_mix(fn):
            return True
        for op, node in first_inputs(fn, depth):
            if op in _UNIT_NODES:
                return True
            if op in _PIECES:  # (a piece that needs no grad is None: nothing known of it)
                pieces = [f for f, _ in node.next_functions]
                return bool(pieces) and depth > 1 and all(
                    f is not None and made_unit(f, depth - 1) for f in pieces)
            if op not in _KEEP_NODES:
                return False
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False


def made_mix(fn) -> bool:
    """Whether autograd node ``fn`` is the add of ``c + (d - c) * s`` (``1 - c`` for
    ``d - c``) of sigmoids ``c``, ``s`` and ``d`` (or a ``d`` that needs no grad: ones), the
    mix the module describes, made before the watched code ran (a 3PL's output)."""
    try:
        if fn is None or node_op(fn) != "Add":
            return False
        ins = [f for f, _ in fn.next_functions]
        for c, mul in (ins, ins[::-1]):
            if c is None or mul is None or node_op(mul) != "Mul" or not _sigmoid(c):
                continue
            for gap, s in ([f for f, _ in mul.next_functions],
                           [f for f, _ in mul.next_functions][::-1]):
                if _sigmoid(s) and gap is not None and _gap_of(gap, c):
                    return True
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False


def _sigmoid(fn) -> bool:
    """Node ``fn`` made a sigmoid (viewed, selected): inside (0, 1)."""
    for op, _ in first_inputs(fn, 4):
        if op == "Sigmoid":
            return True
        if op not in _KEEP_NODES:
            return False
    return False


def _gap_of(gap, c) -> bool:
    """Node ``gap`` is ``1 - c`` or ``d - c`` (d a sigmoid, or needing no grad) of node c."""
    nxt = [f for f, _ in gap.next_functions]
    if node_op(gap) == "Rsub":
        return len(nxt) >= 1 and nxt[0] is c
    return node_op(gap) == "Sub" and len(nxt) == 2 and nxt[1] is c and (
        nxt[0] is None or _sigmoid(nxt[0]))


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """``a`` is ``b`` or holds its values (``exp(eta)`` taken twice, once for the sum)."""
    return b is not None and (a is b or (a.shape == b.shape and bool(torch.equal(a, b))))


def _sum_of_one(s: torch.Tensor, e: torch.Tensor) -> bool:
    """``s = c + e`` has ``c >= 1`` (so ``1 / s`` is below 1): ``s - e`` is 1 or more."""
    return s.shape == e.shape and bool(((s - e) >= 1).all())


def _positive_power(name: str, leaves: list) -> bool:
    """Not ``pow``, or ``pow`` with a positive scalar exponent (|y|^p stays below 1)."""
    if name != "pow":
        return True
    p = leaves[1] if len(leaves) > 1 else None
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0


def _one_or_more(leaves: list) -> bool:
    """The op's scalar operand is at least 1 (``rsub(y, 1)`` is ``1 - y``), with alpha 1."""
    scalars = _scalars(leaves)
    return len(scalars) >= 1 and scalars[0] >= 1 and all(v == 1 for v in scalars[1:])


def _non_negative(leaves: list) -> bool:
    """The op's scalar operand is 0 or more, with alpha 1 (``x + eps``)."""
    scalars = _scalars(leaves)
    return len(scalars) >= 1 and scalars[0] >= 0 and all(v == 1 for v in scalars[1:])


def _halves(name: str, leaves: list) -> bool:
    """The op's one scalar operand scales by at most a half (``0.5 * x``, ``x / 2``)."""
    scalars = _scalars(leaves)
    if len(scalars) != 1:
        return False
    return abs(scalars[0]) <= 0.5 if name == "mul" else abs(scalars[0]) >= 2


def _scalars(leaves: list) -> list[float]:
    return [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]


# what a rounded sigmoid(z)^-b - 1 needs
POWER = ("that 0 is sigmoid(z)^−b − 1 of a sigmoid that exact arithmetic keeps below 1 for "
         "every finite z (its negative power above 1), rounded to 1 in {dt}: compute it from the "
         "logits, sigmoid(z)^−b − 1 = expm1(−b·logsigmoid(z)), so gSASRec's gBCE "
         "log(1 / (sigmoid(z)^−b − 1)) = −log(expm1(−b·logsigmoid(z))) (in float64: "
         "float32's logsigmoid is 0 past z ≈ 100); or clamp the probability below 1 "
         "(p.clamp(eps, 1 − eps) in float64, and y^−b − 1 above eps, as gSASRec's code does)")


def _power_hint(what: str, ev, dt: str) -> str | None:
    """The hint when the 0 is such a y^-b - 1 (:meth:`Saturation.power`), else None."""
    if not any(p and bool((v == 0).any()) for v, p in zip(ev.inputs, ev.power)):
        return None
    return f"{what}: " + POWER.format(dt=dt)


def hint(what: str, divides: bool = False, mix: str = "") -> str:
    """The ``precision`` hint of an op at its pole whose 0 input is such a complement
    (``divides``: the op divides by it, where a probability is trimmed; ``mix``: what a
    3PL's mix needs)."""
    return (f"{what}: that 0 is 1 − y of a y (tanh, sigmoid or exp(z) / (1 + exp(z)), a normal "
            "cdf, a softmax over two or more entries, a mean of such values: a tanh code's bit mean) that exact arithmetic keeps below 1 for every finite argument, "
            "rounded to 1 in float64 too: " + mix + (TRIM if divides else LOGITS) + STABLE)


# what a probability some value is divided by needs
TRIM = ("a probability that divides (an inverse propensity weight t / e + (1 − t) / (1 − e), "
        "an importance weight) is trimmed away from 0 and 1 before it divides: "
        "e.clamp(0.01, 0.99), or e.clamp(eps, 1 − eps) with an eps the type resolves, and so "
        "is a correlation ρ = tanh(·) in 1 − ρ² (a bivariate Gaussian's): "
        "ρ.clamp(−1 + eps, 1 − eps); or ")
# (a binary cross-entropy written by hand: the loss has the logits-form already)
LOGITS = "a binary cross-entropy's log(1 − p) takes the logits, binary_cross_entropy_with_logits; or "


def in_type_hint(name: str, what: str, dt: str, ev) -> str | None:
    """The ``precision`` hint of an op at its pole whose 0 input is such a complement that
    float64 keeps above 0 (a sigmoid of 17 is 1.0 in float32 only), naming the trim a
    divisor needs (the generic hint would blame a cancelled variance); else None."""
    if not rounded_zero(ev.inputs, ev.complement):
        return None
    if said := _power_hint(what, ev, _complement_type(ev) or dt):
        return said
    return (f"{what}: that 0 is 1 − y of a y (tanh, sigmoid or exp(z) / (1 + exp(z)), a "
            f"normal cdf, a softmax over two or more entries, a mean of such values: a tanh code's bit mean) that exact arithmetic keeps below 1 for every finite argument, "
            f"rounded to 1 in {_complement_type(ev) or dt}: " + _mix_said(ev)
            + (TRIM if _divides(name, ev) else LOGITS) + STABLE)


# what a rounded 1 - p of a 3PL's p = c + (1 - c) * sigmoid(z) needs
MIX = ("here y is a mix c + (d − c)·s of such values (a 3PL's guessing floor c = sigmoid(l), "
       "c + (1 − c)·sigmoid(z)), and 1 − y is 0 once c, or both d and s, round to 1: write its "
       "complement as a product, 1 − (c + (1 − c)·sigmoid(z)) = sigmoid(−l)·sigmoid(−z), so "
       "log(1 − p) = logsigmoid(−l) + logsigmoid(−z), and bound c below 1 (c = c_max · "
       "sigmoid(l), a guessing parameter no chance rate reaches 1); ")


def _mix_said(ev) -> str:
    mixed = getattr(ev, "mixed", None) or []
    return MIX if any(m and bool((v == 0).any()) for v, m in zip(ev.inputs, mixed)) else ""


def _complement_type(ev) -> str | None:
    """The type of the complement that is 0: a bfloat16 tanh's 1 - y² divides a float32 value
    under autocast, where the op's own output type is not the one that rounded."""
    for v, c, dt in zip(ev.inputs, ev.complement, ev.input_dtypes):
        if c and bool((v == 0).any()):
            return str(dt).removeprefix("torch.")
    return None


def rounded_hint(name: str, what: str, ev) -> str | None:
    """:func:`hint` when an input of op ``name`` (its :class:`~replay.hits.Evidence` ``ev``)
    is a complement that rounding made 0 (:func:`rounded_zero`), else None."""
    if not rounded_zero(ev.inputs, ev.complement):
        return None
    return _power_hint(what, ev, "float64 too") or hint(what, _divides(name, ev),
                                                         _mix_said(ev))


def _divides(name: str, ev) -> bool:
    """The op divides by the complement (``x / (1 - e)``, ``reciprocal``)."""
    return name == "reciprocal" or (name.startswith("div") and len(ev.complement) > 1
                                    and ev.complement[1])


def rounded_zero(inputs: list[torch.Tensor], complement: list[bool]) -> bool:
    """An input that is 0 somewhere is such a complement: rounding made it 0."""
    return any(c and bool((v == 0).any()) for v, c in zip(inputs, complement))


def _mark(outs: list[torch.Tensor], marks: list) -> bool:
    """Each of ``outs`` added to each of ``marks`` (the sets of what is known of a value);
    True: the op was one of those a tracker follows."""
    for t in outs:
        for m in marks:
            m.add(t)
    return True
