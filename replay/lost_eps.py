"""Guards that rounded away: a positive number added to a value, or clamped under it, that the
value's type rounds to 0; or an eps added that is exactly 0.

A Dice loss written for float32, ``(2 * inter) / (card + 1e-8)``, run in float16 (a model and
loss made ``.half()``): 1e-8 is below float16's smallest subnormal (5.96e-08), so ``card + 1e-8``
is ``card``, and an empty class's 0 is divided as if no eps were there. :class:`LostEps` marks
the outputs of such ops as the op finder sees them; the blamed op's evidence says which of its
inputs carry one (:attr:`replay.hits.Evidence.lost_eps`), and :func:`context` says so.
:class:`GuardNodes` does the same for a backward origin: BasicSR's Charbonnier loss,
``sqrt(d ** 2 + 1e-12)`` in float16, is ``sqrt(0)`` where a pixel is exact, and sqrt's
backward node at that pole took the output of an ``add`` whose eps was lost. An eps set to 0
in the options (BasicSR's Charbonnier ``sqrt(d ** 2 + eps)``, NAFNet's PSNR loss
``log(mse + eps)``, SSIM's ``C2`` in ``sigma1 + sigma2 + C2``) guards nothing either: the hint
"add an eps" is no fix for a user who has one, so that one is said too: for ``add``, and for a
clamp whose only bound is a floor of exactly 0 under a value with no negative entry, which it
leaves as it is (OpenFold's torsion-angle norm ``sqrt(clamp(sum(s ** 2), min=eps))`` with eps
0); a clamp to a range, ``x.clamp(0, 1)``, or one of values below 0 (a ReLU) is no eps. A
divisor made of guarded values carries their eps (:class:`CarriedEps`): a kernel feature map's
``relu(x) + kernel_epsilon`` (performer-pytorch's ``generalized_kernel``) with the eps set to 0
makes queries and keys of exact 0s, and ``1 / (q . k_cumsum)`` divides by their products' sum.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .rounded_bound import RoundedBound, moved_bound, rounded_bound
from .rounded_bound import said as said_bound

# ops that take a guard as a number: t + eps, t.clamp_min(eps), t.clamp(min=eps)
_GUARDS = {"add", "add_", "clamp", "clamp_", "clamp_min", "clamp_min_"}
# ops that keep the guarded value's 0 at 0: sqrt(n2 + eps) is as unguarded as n2 + eps (a
# capsule's squash, s / sqrt(|s|^2 + eps); pow with a positive exponent)
_KEEP_ZERO = {"sqrt", "pow"}
# ops whose output is made of their one input's guarded values: moved, copied, summed (F.normalize's
# x / norm.clamp_min(eps).expand_as(x) divides by the guard itself)
# (not a cast: an eps float16 lost is no longer said of the float32 copy's type)
_CARRY_ONE = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
              "unsqueeze", "squeeze", "clone", "contiguous", "alias", "slice", "select", "sum",
              "cumsum"}
# products, each of whose factors must be guarded: w @ (x + eps) has no floor (w may be 0)
_CARRY_ALL = {"mul", "bmm", "mm", "matmul", "dot"}


class CarriedEps(float):
    """The eps of the guarded factors a product (or a sum of products) was made of, not one
    added to it: the hint says where it was added."""


class LostEps:
    def __init__(self) -> None:
        self._of: dict[int, tuple[weakref.ref, float]] = {}

    def track(self, name: str, args: Sequence[Any], out: Any) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not args:
            return
        if name in _KEEP_ZERO and isinstance(args[0], torch.Tensor) and \
                (kept := self.of(args[0])) is not None and (name == "sqrt" or len(args) > 1 and (
                    _positive(args[1]))):
            self._of[id(out)] = (weakref.ref(out), kept)
            return
        if (carried := self._carried(name, args)) is not None:
            self._of[id(out)] = (weakref.ref(out), carried)
            return
        if (shifted := self._shifted(name, args)) is not None:  # (1 - p of a p clamped)
            self._of[id(out)] = (weakref.ref(out), shifted)
            return
        if name not in _GUARDS or len(args) < 2:
            return
        if name.startswith("clamp") and (bound := rounded_bound(args, {}, out)) is not None:
            self._of[id(out)] = (weakref.ref(out), bound)  # (onto ndtri's edge: p.clamp(max=1 - 1e-8))
            return
        eps = args[1]
        if _lost(eps, out) or name in _ADDS and _zero(eps, out):
            self._of[id(out)] = (weakref.ref(out), float(eps))
        elif name not in _ADDS and _zero_floor(args, out):
            self._of[id(out)] = (weakref.ref(out), Floor(0.0))

    def _carried(self, name: str, args: Sequence[Any]) -> float | None:
        """The eps of the guarded values the op's output is made of, or None: a view, copy or
        sum keeps its input's; a product of guarded factors carries theirs."""
        if name in _CARRY_ONE:
            return self.of(args[0]) if isinstance(args[0], torch.Tensor) else None
        if name not in _CARRY_ALL:
            return None
        eps = [self.of(a) for a in args if isinstance(a, torch.Tensor)]
        return CarriedEps(max(eps)) if eps and None not in eps else None

    def _shifted(self, name: str, args: Sequence[Any]) -> RoundedBound | None:
        """A clamp's rounded bound a value shifted by a number keeps (``1 - p``, ``p - 1``),
        with the value the shift has there, or None."""
        shift = _SHIFTS.get(name)
        if shift is None or len(args) < 2 or not isinstance(args[0], torch.Tensor):
            return None
        bound, c = self.of(args[0]), _number(args[1])
        if not isinstance(bound, RoundedBound) or c is None:
            return None
        return bound.shifted(shift(bound.at, c))

    def of(self, t: torch.Tensor) -> float | None:
        """The guard ``t`` was made with that its type rounded to 0, or None."""
        hit = self._of.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None


_ADDS = {"add", "add_"}
# shifts of a clamped value by a number (``1 - p`` is aten.rsub(p, 1)): the value they have at
# the clamp's bound
_SHIFTS = {"rsub": lambda v, c: c - v, "sub": lambda v, c: v - c}


def _number(c: Any) -> float | None:
    """``c`` as a float: a Python number or a 0-d floating constant (a wrapped scalar; not a
    learned one), else None."""
    if isinstance(c, torch.Tensor):
        return float(c) if c.dim() == 0 and c.is_floating_point() and not c.requires_grad \
            else None
    return None if isinstance(c, bool) or not isinstance(c, (int, float)) else float(c)


def _positive(p: Any) -> bool:
    """An exponent above 0, a number or a tensor (PCEN's learned ``alpha`` in
    ``(eps + M) ** alpha``): the power keeps the unguarded 0 at 0."""
    if isinstance(p, torch.Tensor):
        return p.is_floating_point() and bool((p > 0).all())
    return not isinstance(p, bool) and isinstance(p, (int, float)) and p > 0


class Floor(float):
    """An eps that is a clamp's floor under the value, not added to it (its words differ)."""


def _zero_floor(args: Sequence[Any], out: Any) -> bool:
    """A clamp's only bound (``args``: the value, the floor, no ceiling) is a float floor of
    exactly 0 under a floating value it leaves unchanged: one with no negative entry, so the
    clamp guards nothing (one host read, on the replay's slow path)."""
    x, eps = args[0], args[1]
    return _zero(eps, out) and (len(args) < 3 or args[2] is None) \
        and isinstance(x, torch.Tensor) and x.is_floating_point() and not bool((x < 0).any())


def _zero(eps: Any, out: Any) -> bool:
    """``eps`` is a float exactly 0 added to the floating ``out`` (an int 0 is rather the start
    of Python's ``sum()`` or of a loop's total than an eps)."""
    return isinstance(out, torch.Tensor) and out.is_floating_point() \
        and isinstance(eps, float) and eps == 0


def _lost(eps: Any, out: Any) -> bool:
    """``eps`` is a positive number that ``out``'s floating type rounds to 0."""
    return isinstance(out, torch.Tensor) and out.is_floating_point() \
        and not isinstance(eps, bool) and isinstance(eps, (int, float)) and eps > 0 \
        and eps <= smallest(out.dtype) / 2  # (round to nearest even: half of it is 0 too)


class GuardNodes(TorchFunctionMode):
    """Inside the block, the autograd nodes of the guards (``x + eps``, ``x.clamp_min(eps)``,
    ``x.clamp(min=eps)``) whose eps the output's type rounded to 0. Kept as the nodes
    themselves (strong references, for the block's one re-run): a node's ``next_functions``
    give back the same objects."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[tuple[Any, float]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "").strip("_").removeprefix("r").removeprefix("i")
        if name.rstrip("_") in _GUARDS and len(args) >= 1:
            eps = args[1] if len(args) > 1 else kwargs.get("min", kwargs.get("other"))
            zero = name in _ADDS and _zero(eps, out) and "radd" not in getattr(func, "__name__", "")
            floor = name not in _ADDS and isinstance(out, torch.Tensor) and _zero_floor(
                (args[0], eps, args[2] if len(args) > 2 else kwargs.get("max")), out)
            if (_lost(eps, out) or zero or floor) and out.grad_fn is not None:
                self.nodes.append((out.grad_fn, Floor(0.0) if floor else float(eps)))
            elif name.startswith("clamp") and getattr(out, "grad_fn", None) is not None and \
                    (bound := rounded_bound(args, kwargs, out)) is not None:
                self.nodes.append((out.grad_fn, bound))  # (onto acos's edge: replay.rounded_bound)
        return out

    def of(self, node) -> float | None:
        """The lost eps of a guard whose output ``node`` takes, or None."""
        try:
            nexts = [fn for fn, _ in node.next_functions if fn is not None]
        except Exception:  # not an autograd node, or one that cannot say
            return None
        direct = next((eps for fn in nexts for n, eps in self.nodes if fn is n), None)
        return direct if direct is not None else moved_bound(self.nodes, nexts)


def smallest(dtype: torch.dtype) -> float:
    """The type's smallest positive (subnormal) number."""
    f = torch.finfo(dtype)
    return f.smallest_normal * f.eps


def context(ev) -> str:
    """The hint's addition when an input the op took at 0 was guarded by an eps its type
    rounded to 0 (``""`` when none)."""
    first = _first(ev)
    return said(*first) if first else ""


def zero(ev) -> bool:
    """The eps :func:`context` says is one exactly 0 (a choice, not a rounding: what the hint
    says besides, a mask after the op, still holds). An op on data alone guarded so is no
    degenerate record either: the code foresaw zeros there, and the eps is their fix."""
    first = _first(ev)
    return first is not None and first[0] == 0


def _first(ev) -> tuple[float, torch.dtype] | None:
    """The lost eps of the op's first input it took at 0, and that input's type; an eps
    exactly 0 only when no input's was lost to rounding, and the last such input's (a
    quotient's divisor: ``(2 * inter + smooth) / (card + smooth + 1e-8)`` with smooth 0 in
    float16 lost the 1e-8)."""
    hits = [(eps, ev.input_dtypes[i]) for i, eps in enumerate(ev.lost_eps)
            if eps is not None and ev.elementwise[i] and bool((ev.inputs[i] == (
                eps.at if isinstance(eps, RoundedBound) else 0)).any())]
    return next((h for h in hits if h[0] != 0), hits[-1] if hits else None)


def unless_bound(ev, advice: str) -> str:
    """``advice`` (a stable formula, a clamp to the domain), or ``""`` where :func:`context`
    names a clamp of the code's whose bound the type rounded onto the edge: its own fix."""
    first = _first(ev)
    return "" if first is not None and isinstance(first[0], RoundedBound) else advice


def rounded_guard(ev, i: int, w: float) -> bool:
    """Input ``i`` of the op, a 0 that is ``w`` in float64, is ``x + eps`` whose eps its type
    rounded to 0, and ``w`` is mostly that eps (``x`` is 0 or below it: a black pixel's
    ``max + 1e-8``): :func:`context`'s advice (an eps the type keeps) is the fix, not a
    wider type or a log-space rewrite of a value that underflowed (a mean square of 1.75e-8,
    whose eps of 1e-12 adds nothing, needs those)."""
    eps = ev.lost_eps[i] if i < len(ev.lost_eps) else None
    return eps is not None and abs(w) <= 2 * eps and bool(context(ev))


def said(eps: float, dt: torch.dtype) -> str:
    """The hint's addition for an ``eps`` that ``dt`` rounded to 0, or one exactly 0."""
    name, tiny = str(dt).removeprefix("torch."), torch.finfo(dt).tiny
    if isinstance(eps, RoundedBound):  # (a clamp's bound on the edge: the input at it)
        return said_bound(eps)
    if isinstance(eps, Floor):
        return ("; the floor that input is clamped to is exactly 0 (an eps option set to 0, "
                "or 0 meant as 'off'), and it has no negative entry, so the clamp guarded "
                f"nothing: set it to a positive value, at least {tiny:.3g} in {name} (such "
                "eps's default to 1e-12 to 1e-6)")
    if isinstance(eps, CarriedEps):  # (a product of two guarded factors is eps ** 2 at least)
        where = "the values that input is a sum of products of (x + eps before the product)"
        least = (f"at least {tiny ** 0.5:.3g} (the square root of {name}'s smallest normal "
                 "number: the product of two guarded factors holds eps squared)")
        zero_least, lost_least = least, least
    else:
        where = "that input"
        zero_least = f"at least {tiny:.3g} in {name} (such eps's default to 1e-12 to 1e-6)"
        lost_least = f"{name} keeps (at least its smallest normal number, {tiny:.3g})"
    if eps == 0:
        return (f"; the eps added to {where} is exactly 0 (an eps option set to 0, or 0 "
                "meant as 'off'), so it guarded nothing: set it to a positive value, "
                + zero_least)
    return (f"; the eps {eps:g} added to {where} is 0 in {name} (its smallest positive "
            f"number is {smallest(dt):.3g}), so it guarded nothing: use an eps {lost_least} "
            "or compute this in float32")
