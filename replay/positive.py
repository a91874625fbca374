"""Values positive in exact arithmetic for every finite argument, so that a 0 they hold is a
positive value that underflowed (``underflow``, not ``invalid``).

exp, softmax, sigmoid and softplus make them; ops that pass values on unchanged keep them
(a gathered probability, a view; a top-k, a sort or a max picks entries of them: a sigmoid
router's top-k scores), and so do a ``prod`` of factors > 0 and a power of a base > 0,
whatever made those values (a likelihood of many probabilities), a power of one
(``std ** 2``: a Gaussian's variance from ``log_std.exp()``), a product of them with positive factors (``2 * var``), and
a sum of them: a reduction, or a matrix product with a tensor whose values are all > 0
(Sinkhorn's ``K @ v`` with ``K = exp(-C / eps)``, whose row of zeros is an underflow) or
with one >= 0 with a positive term in every entry (a demapper's ``exp(-d / no) @ labels``).
Followed both as the op finder sees ops run and, for a value made before the watched code
ran (a model's softplus variance that the loss takes the log of), on the autograd graph.
"""

from __future__ import annotations

import math
import weakref

import torch

from .compat import saved_value, tree_leaves, tree_map
from .kept_signs import recall, remember

# Ops whose result is positive in exact arithmetic for every finite argument: a 0 they return
# is an underflow. Ops that pass values on unchanged keep that mark (a gathered probability).
POSITIVE = {"exp", "exp2", "_softmax", "softmax", "sigmoid", "special_expit", "softplus"}
# POSITIVE in words, for a hint: a 0 they made underflowed
POSITIVE_OPS = "exp, softmax, sigmoid or softplus"
PASS_ON = {"gather", "index_select", "select", "slice", "view", "_unsafe_view", "reshape",
           "squeeze", "unsqueeze", "clone", "_to_copy", "expand", "permute", "transpose", "t",
           "contiguous", "alias", "narrow", "take_along_dim", "index", "unbind", "split",
           "split_with_sizes", "detach", "masked_select", "flatten", "unflatten", "diagonal",
           "as_strided", "div",  # div: a positive value over a finite one stays non-zero
           "sqrt"}  # (pow: OF_POSITIVE_VALUES, by its base, which may be a number: (-2) ** t)
# sums of products of their inputs' elements: positive when every term is (a row sum of
# exp, K @ v of a positive kernel and positive scalings)
SUMS = {"add", "mm", "bmm", "mv", "dot", "vdot"}
REDUCTIONS = {"sum", "mean", "cumsum"}  # (their numbers are dims)
# ops each of whose result entries is one of their inputs' entries (a router's top-k scores,
# a row max): positive where every floating input is (a binary minimum needs both)
SELECTS = {"topk", "sort", "msort", "kthvalue", "median", "nanmedian", "mode", "max", "amax",
           "min", "amin", "maximum", "minimum", "fmax", "fmin", "cummax", "cummin", "flip",
           "roll", "repeat", "tile", "movedim", "sort_stable"}
# ops whose exact result is positive where their floating inputs' values all are (any
# finite exponent of a base > 0; a product of factors > 0, however many: a likelihood of
# independent probabilities), whatever made those values
OF_POSITIVE_VALUES = {"prod", "pow", "cumprod"}


def node_name(op: str) -> str:
    """A backward node's name (``Backward<n>`` dropped) for aten op ``op``: ``IndexSelect`` for
    ``index_select``, ``UnsafeView`` for ``_unsafe_view``."""
    return "".join(part.capitalize() for part in op.split("_"))


# The same rule on the autograd graph, for a value made before the watched code ran (a
# model's softplus variance that the loss takes the log of); a reshape's node is ReshapeAlias
_POSITIVE_NODES = {node_name(op) for op in POSITIVE}
# (a node keeps no number: Pow's first input is its base, or a number base's exponent)
_PASS_ON_NODES = {node_name(op) for op in PASS_ON | REDUCTIONS} | {"ReshapeAlias", "Pow"} | {
    node_name(op) for op in SELECTS - {"maximum", "minimum", "fmax", "fmin"}}  # (one input)
# matrix products, with the names their nodes save their factors under
_PRODUCT_NODES = {"Bmm": ("self", "mat2"), "Mm": ("self", "mat2"), "Mv": ("self", "vec")}


def node_op(node) -> str:
    name = node.name()
    return name[: name.rfind("Backward")] if "Backward" in name else name


def positive_result(name: str, ins: list[torch.Tensor], leaves: list, positive) -> bool:
    """Whether op ``name``, given finite inputs ``ins`` (``leaves``: all its arguments), made
    a value positive in exact arithmetic; ``positive(t)`` says it of an input."""
    if name in POSITIVE or (name in PASS_ON and ins and positive(ins[0])):
        return True
    if name in SELECTS:
        return bool(ins) and all(positive(t) for t in ins)
    if name in OF_POSITIVE_VALUES and leaves:  # (pow's base only: its exponent may be < 0)
        factors = leaves[:1] if name == "pow" else ins
        return all(positive(t) or bool((t > 0).all()) if isinstance(t, torch.Tensor)
                   else isinstance(t, (int, float)) and t > 0 for t in factors)
    if (name in REDUCTIONS or name in SUMS) and any(t.numel() == 0 for t in ins):
        return False  # (a sum of no terms is an exact 0: exp(x).sum(-1) of an empty set)
    if name in REDUCTIONS and ins and positive(ins[0]):
        return True
    numbers = [v for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if name == "where" and ins and any(positive(t) for t in ins):
        # (each element is one of its branches': positive where both are, a Bernoulli-Gamma
        # likelihood's ``where(wet, p * pdf, 1 - p)``)
        return all(v > 0 for v in numbers) and all(
            positive(t) or bool((t > 0).all()) for t in ins)
    if (name in SUMS or name == "mul") and not _integral_positive(leaves):
        return False  # (``exp(s) * mask`` of a bool mask: its 0s are the mask's, exact)
    if name in SUMS and ins and any(positive(t) for t in ins):
        # every term positive: the other factors' values all > 0 (v = ones, b / (K^T u));
        # the inputs are finite here, so ``> 0`` reads their values (add's alpha too)
        return all(v > 0 for v in numbers) and all(
            positive(t) or bool((t > 0).all()) or _covers(name, ins, i)
            for i, t in enumerate(ins))
    # a product of positive tensors and positive numbers (2 * var), or of one and factors
    # whose values are all > 0 here (a Gamma density's ``y ** (a - 1) * exp(-y / b)`` of rain
    # amounts > 0): no factor is 0, so a 0 of it underflowed
    return name == "mul" and any(positive(t) for t in ins) and all(
        positive(t) or bool((t > 0).all()) for t in ins) and all(v > 0 for v in numbers)


# the dim each factor of a matrix product sums over, by the factor's position
_CONTRACTED = {"mm": (-1, -2), "bmm": (-1, -2), "mv": (-1, -1), "dot": (-1, -1)}


def _covers(name: str, ins: list[torch.Tensor], i: int) -> bool:
    """Factor ``i`` of matrix product ``name`` is >= 0 with a positive entry in each slice it
    sums over, so a positive other factor's product has a positive term in every entry (a
    demapper's ``exp(-d / no) @ labels`` of 0/1 bit labels, each bit 1 at some point)."""
    t = ins[i]
    if name not in _CONTRACTED or len(ins) != 2 or t.is_complex() or t.dim() == 0:
        return False
    return bool((t >= 0).all()) and bool((t > 0).any(_CONTRACTED[name][i]).all())


def _integral_positive(leaves: list) -> bool:
    """Every bool or integer tensor among an op's arguments (which ``ins``, the float ones,
    leaves out) is > 0: a factor or term that cannot make the result 0."""
    return all(bool((v > 0).all()) for v in leaves if isinstance(v, torch.Tensor)
               and not v.is_floating_point() and not v.is_complex())


# nodes of a sum per segment written by hand (index_add_ or scatter_add_ into a constant: a
# graph's atoms, a hand-written softmax's per-graph denominator)
_SEGMENT_SUM_NODES = {"IndexAdd", "ScatterAdd"}


def segment_sum_of_positive(node, depth: int = 8) -> bool:
    """Whether division node ``node``'s divisor is, through views and selections, a segment sum
    of values positive in exact arithmetic (exp of attention scores summed per graph with
    ``index_add_``): positive in every segment with a member, so a divisor there that is
    tiny, not 0, is an underflow of its terms. (An empty segment's exact 0 is no underflow:
    callers ask only of a divisor holding no 0.)"""
    try:
        nexts = [fn for fn, _ in node.next_functions]
        for op, fn in first_inputs(nexts[1] if len(nexts) > 1 else None, depth):
            if op in _SEGMENT_SUM_NODES:
                into, source = [f for f, _ in fn.next_functions][:2]
                return into is None and made_positive(source, depth)
            if op not in _PASS_ON_NODES:
                return False
    except Exception:  # not an autograd node, or one that cannot say
        return False
    return False


def first_inputs(fn, depth: int = 8):
    """(op, node) of autograd node ``fn`` and the nodes of its first input after it, at most
    ``depth``: the path a value took from the op that made it, through views and selections.
    A first input without a node (data, a constant: the ``y`` of ``y / mu``, the base of
    ``conc ** hill``) ends it: what made the value is not in the graph, not the next input."""
    for _ in range(depth):
        if fn is None:
            return
        yield node_op(fn), fn
        nexts = fn.next_functions
        fn = nexts[0][0] if nexts else None


def made_positive(fn, depth: int = 8) -> bool:
    """Whether autograd node ``fn`` made its value by exp, softmax, sigmoid or softplus
    (directly, or viewed, gathered, sliced, divided, raised to a power, multiplied by
    constant factors of one sign, negated), so that it is never 0 in exact arithmetic: a 0
    it holds underflowed (a natural parameter's ``-0.5 * exp(f)`` too). ``depth`` bounds the
    walk."""
    return made_sign(fn, depth) != 0


def made_sign(fn, depth: int = 8) -> int:
    """1 (-1) when autograd node ``fn`` made a value positive (negative) in exact arithmetic
    for every finite argument (see :func:`made_positive`), 0 when it cannot say."""
    sign = _walk(fn, depth)
    return sign if sign in (1, -1) else 0


def made_nonzero(fn, depth: int = 8) -> bool:
    """Whether autograd node ``fn`` made a value non-zero in exact arithmetic, of one sign or
    of either (a signed amplitude ``exp(s) * polarity`` of a +-1 buffer): a 0 it holds
    underflowed, and a division by it or a log of its square has no pole there."""
    return _walk(fn, depth) != 0


def keep_signs(tensors) -> list:
    """Verdicts on the nodes that made ``tensors``, taken now, before a backward frees the
    values the rules read (:mod:`replay.kept_signs`); the caller keeps them alive."""
    return [remember(t.grad_fn, _walk(t.grad_fn, 8)) for t in tensors
            if isinstance(t, torch.Tensor) and t.grad_fn is not None]


# a value non-zero in exact arithmetic whose entries are of either sign (no one sign)
NONZERO = 2
# pass-on nodes that add entries up: a sum of values of either sign may be an exact 0
_SUM_NODES = {node_name(op) for op in REDUCTIONS}


def _times(a: int, b: int) -> int:
    """The sign of a product of factors of signs ``a`` and ``b`` (:data:`NONZERO` included)."""
    return 0 if 0 in (a, b) else NONZERO if NONZERO in (a, b) else a * b


def _walk(fn, depth: int) -> int:
    """1, -1, :data:`NONZERO` or 0 (unknown) for the value autograd node ``fn`` made."""
    sign, summed = 1, False
    try:
        for op, node in first_inputs(fn, depth):
            if (kept := recall(node)) is not None:  # (taken before a backward freed the node)
                made = kept
            elif op in _POSITIVE_NODES:
                made = 0 if _masked_input(node, depth) else 1
            elif op == "Neg":
                sign = -sign
                continue
            elif op == "Mul":
                made = _product_sign(node, depth - 1)
            elif op == "Add":  # (a mixture's pi1 * N1 + pi2 * N2, both terms positive)
                made = _sum_sign(node, depth - 1)
            elif op == "Pow":  # (its first input: a number base's exponent, 2 ** t)
                made = _power_sign(node, depth - 1)
            elif op in _PRODUCT_NODES:  # (Sinkhorn's K^T @ u)
                made = _product_sign(node, depth - 1, _PRODUCT_NODES[op], saved=True)
            elif op in _PASS_ON_NODES:
                summed = summed or op in _SUM_NODES
                continue
            else:
                return 0
            return 0 if summed and made == NONZERO else _times(sign, made)
    except Exception:  # not an autograd node, or one that cannot say
        return 0
    return 0


# nodes of ops that replace some positions with a value the graph does not hold (a mask's
# fill, often -inf: where(active, logits, -inf), masked_fill, x[m] = -inf)
_FILL_NODES = {"Where", "MaskedFill", "IndexPut"}


def _masked_input(fn, depth: int) -> bool:
    """The input of exp/softmax node ``fn`` came, through views, from a fill: a 0 it holds
    may be exp(-inf) of a masked position, exact, not an underflow (the graph keeps no
    input value to tell; the op finder, which sees the -inf, never marks that result)."""
    nxt = next((f for f, _ in fn.next_functions if f is not None), None)
    for op, _ in first_inputs(nxt, depth):
        if op in _FILL_NODES:
            return True
        if op not in _PASS_ON_NODES:
            return False
    return False


def filled_mask(t: torch.Tensor, fn=None) -> torch.Tensor | None:
    """Where a value made before the watched code ran (a model's alpha masks) is positive,
    when exp/softmax (autograd node ``fn``, by default its own) made it of an input a fill
    replaced (:func:`_masked_input`): at its non-zero entries, its zeros being masked
    positions or underflows alike; else None."""
    fn = getattr(t, "grad_fn", None) if fn is None else fn
    try:
        if fn is None or node_op(fn) not in _POSITIVE_NODES or not _masked_input(fn, 8):
            return None
        return t.detach() != 0
    except Exception:  # (a node that cannot say)
        return None


def _sign_of(t) -> int:
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0  # (an empty tensor is all > 0 vacuously, of no sign)
    return 1 if bool((t > 0).all()) else -1 if bool((t < 0).all()) else (
        NONZERO if bool((t != 0).all()) else 0)  # (a +-1 polarity: no 0 among its values)


# nodes of step functions, constant where they have a gradient: their values are exact (a
# sign(w) factor's +-1 is a constant's, saved for the other factor's gradient)
_STEP_NODES = {"Sign", "Sgn"}


def _product_sign(fn, depth: int, names=("self", "other"), saved: bool = False) -> int:
    """The sign of a ``MulBackward0`` (or a matrix product's node) whose factors each have
    one, made so or a constant of one sign (a factor without a gradient: the node saved it
    for the other's). With ``saved``, a factor's saved value of one sign counts too (a matrix
    product saves both: Sinkhorn's scaling ``u``, positive by its values, however many
    iterations made it). A matrix product's terms add up: its factors must be positive."""
    nexts = [f for f, _ in fn.next_functions]
    values = [saved_value(fn, n) for n in names]
    if saved and any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in values):
        return 0  # (a product over an empty inner dim, rank 0's LoRA: a sum of no terms)
    sign = 1
    for i, f in enumerate(nexts[:2]):
        # (values[i]: factor i's value, saved for the other factor's gradient)
        s = _walk(f, depth) if f is not None else 0
        if s == 0 and (f is None or saved or node_op(f) in _STEP_NODES):
            s = _sign_of(values[i])
        if s == 0 or (saved and s != 1):  # (a matrix product's terms add up: all > 0)
            return 0
        sign = _times(sign, s)
    return sign


def _power_sign(fn, depth: int) -> int:
    """The sign of a power's node: positive for every exponent when its base is (a number
    base's ``2 ** t``, ``torch.pow(0.5, t)``: the node's one input is the exponent, whose sign
    says nothing); a negative base's by an integral exponent's parity; else unknown."""
    if fn.name() == "PowBackward2":  # (number ** tensor)
        base = saved_value(fn, "self")
        return 1 if isinstance(base, (int, float)) and base > 0 else 0
    nxt = fn.next_functions[0][0]  # (the base; None: a constant base, tensor ** tensor)
    sign = _walk(nxt, depth) if nxt is not None else _sign_of(saved_value(fn, "self"))
    exponent = saved_value(fn, "exponent")
    if sign == NONZERO:  # (either sign: an integral power keeps it non-zero, an even one > 0)
        integral = isinstance(exponent, (int, float)) and float(exponent).is_integer()
        return 0 if not integral else 1 if exponent % 2 == 0 else NONZERO
    if sign >= 0 or not isinstance(exponent, (int, float)) or not float(exponent).is_integer():
        return max(sign, 0)
    return 1 if exponent % 2 == 0 else -1


def _sum_sign(fn, depth: int) -> int:
    """The sign of an ``AddBackward0`` (``a + alpha * b``, alpha > 0) whose two terms have the
    same one."""
    alpha = saved_value(fn, "alpha")
    nexts = [f for f, _ in fn.next_functions]
    if (isinstance(alpha, (int, float)) and alpha <= 0) or len(nexts) != 2 or None in nexts:
        return 0
    a, b = _walk(nexts[0], depth), _walk(nexts[1], depth)
    return a if a == b and a in (1, -1) else 0


def exp_of_parameter(fn, depth: int = 10):
    """The leaf tensor (a parameter) whose exp made the value of autograd node ``fn``, through
    the ops :func:`made_positive` follows (``exp(log_std) ** 2``, expanded, times 2), or None:
    a learned log-scale that drifted until its exp underflowed (a Gaussian policy's
    ``log_std``)."""
    try:
        for _ in range(depth):
            if fn is None:
                return None
            op = node_op(fn)
            if op == "Exp":
                return _leaf(next((f for f, _ in fn.next_functions if f is not None), None))
            if op not in _PASS_ON_NODES and op != "Mul":
                return None
            fn = next((f for f, _ in fn.next_functions if f is not None), None)
    except Exception:  # not an autograd node, or one that cannot say
        return None
    return None


def _leaf(fn, depth: int = 6):
    """The tensor an ``AccumulateGrad`` node accumulates into, reached through views."""
    for _ in range(depth):
        if fn is None:
            return None
        if type(fn).__name__ == "AccumulateGrad" or fn.name().endswith("AccumulateGrad"):
            return getattr(fn, "variable", None)
        if node_op(fn) not in _PASS_ON_NODES:
            return None
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return None


# ops that, given a value positive at some positions, keep it positive where their terms are:
# views and sums of it (positive factors kept as they are), stacks and products of it
_PARTLY_KEEP = PASS_ON | REDUCTIONS | SUMS | {"mul", "stack", "cat"}
# ops whose result is positive in exact arithmetic where their argument is not -inf (softmax
# of masked scores: its 0 at a masked entry is the mask's, not an underflow)
_PARTLY_MAKE = {"exp", "exp2", "sigmoid", "special_expit", "_softmax", "softmax"}


class Partly:
    """Values positive in exact arithmetic at some positions only, each with its bool mask:
    exp of scores holding -inf (soft-DTW's ``exp(-R / gamma)`` beside ``R``'s +inf borders, a
    masked row), and what views, stacks, products and sums make of them (a textbook softmin's
    ``exp(-r / gamma).sum(-1)`` is positive wherever one of its terms is). Held weakly, by
    tensor identity, like :class:`replay.memo.TensorSet`."""

    def __init__(self):
        self._masks: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        # those a square made (``re ** 2``), or views, sums and roots of one
        self._squares: dict[int, weakref.ref] = {}

    def squared(self, t: torch.Tensor) -> bool:
        hit = self._squares.get(id(t))
        return hit is not None and hit() is t

    def mark_filled(self, fn, t: torch.Tensor) -> None:
        """Mark ``t``, a detached copy of the value autograd node ``fn`` made, with
        :func:`filled_mask`'s positions."""
        if (m := filled_mask(t, fn)) is not None:
            self._masks[id(t)] = (weakref.ref(t), m)

    def mask(self, t: torch.Tensor) -> torch.Tensor | None:
        hit = self._masks.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else filled_mask(t)

    def at(self, t: torch.Tensor, bad: torch.Tensor) -> bool:
        """``t`` is positive at every position of ``bad`` (the op's non-finite output)."""
        m = self.mask(t)
        try:
            return m is not None and bool(torch.broadcast_to(m, bad.shape)[bad].all())
        except RuntimeError:  # (not elementwise with the output)
            return False

    def track(self, func, name: str, given: tuple, ins: list[torch.Tensor],
              outs: list[torch.Tensor], positive) -> torch.Tensor | None:
        """Mark ``outs[0]`` with where op ``func`` made it positive; ``positive(t)``: ``t`` is
        positive everywhere (returned: the mask, all True for a value positive everywhere).
        Only exp and the ops given a partly positive value pay."""
        square = _square(name, given)
        if outs and (square or name in _PARTLY_KEEP and any(self.squared(t) for t in ins)):
            self._squares[id(outs[0])] = weakref.ref(outs[0])
        if not ins or not (name in _PARTLY_MAKE or square or name in _PARTLY_KEEP and any(
                self.mask(t) is not None for t in ins)) or any(
                bool(t.isnan().any()) for t in ins):
            return None
        if name in _PARTLY_MAKE:
            m = torch.broadcast_to(ins[0].detach() > -math.inf, outs[0].shape)
        elif square:  # (positive where the base is not 0: a 0 there underflowed)
            m = torch.broadcast_to(ins[0].detach() != 0, outs[0].shape)
        else:
            m = self._kept(func, name, given, positive)
        if m is not None and not bool(m.all()) and bool(m.any()):
            self._masks[id(outs[0])] = (weakref.ref(outs[0]), m)
        return m

    def _kept(self, func, name: str, given: tuple, positive) -> torch.Tensor | None:
        """Where ``func`` keeps its result positive: run on stand-ins (1 where an input is
        positive, 0 where it is not), its result is non-zero exactly there. None when a term
        may be negative (a sum or product could cancel)."""
        view, pieces = name in PASS_ON, name in ("stack", "cat")
        seen, negative = [], []

        def stand_in(v):
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                return v
            seen.append(v)
            if (m := self.mask(v)) is not None:
                return m.to(v.dtype)
            if positive(v) or (not view and bool((v > 0).all())):
                return torch.ones_like(v)
            if view and len(seen) > 1:  # (a view's other inputs stay: div's denominator)
                return v.detach()
            negative.append(not view and not pieces)
            return torch.zeros_like(v)  # (a piece positive nowhere)

        numbers = [v for v in tree_leaves(given) if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        if name in ("mul", "add") and any(v <= 0 for v in numbers):
            return None  # (a factor or alpha <= 0)
        args, kwargs = tree_map(stand_in, given[0]), tree_map(stand_in, given[1])
        if any(negative):
            return None
        try:
            with torch.no_grad():
                out = func(*args, **kwargs)
        except Exception:  # (an op refusing its stand-ins: no mark, the replay goes on)
            return None
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out != 0 if isinstance(out, torch.Tensor) else None


def _square(name: str, given: tuple) -> bool:
    """Op ``name`` given ``(args, kwargs)`` squares its first argument (``x ** 2``, ``x * x``)."""
    args = given[0] if given and isinstance(given[0], (tuple, list)) else ()
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return False
    return (name == "pow" and isinstance(args[1], (int, float)) and args[1] == 2) or (
        name == "mul" and args[1] is args[0])
