"""A backward origin at log(0) or 1/0 whose 0 is ``1 - y`` of a y exact arithmetic keeps
below 1: the derivative's pole reached by rounding, not by the math (``precision``).

The forward op finder tells it from the ops themselves (``replay.saturation``); a backward
origin has only the graph: ``LogBackward0`` of ``RsubBackward1`` of a ``TanhBackward0`` or a
``SoftmaxBackward0``. A softmax is below 1 only where its slice held two or more entries above
-inf, which its node does not keep, so :class:`BelowOneNodes` notes those softmaxes as the
backward finder's re-run makes them. Relaxed top-k (Xie & Ermon's subset sampling) is the
case: ``w + log(1 - softmax(w / t))`` without the reference code's clamp, once the softmax
rounds a clear winner to 1.0 (in float64 too).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .cause_result import Cause
from .positive import node_op
from .saturation import hint, made_unit

_UNIT = {"erf", "special_erf", "tanh", "sigmoid", "special_expit"}
_ADD = {"add", "__add__", "__radd__"}
_SCALE = {"mul", "__mul__", "__rmul__", "div", "__truediv__"}


class BelowOneNodes(TorchFunctionMode):
    """Inside the block, the autograd nodes of softmaxes whose every slice held two or more
    entries above -inf and no NaN or +inf: below 1 in exact arithmetic everywhere."""

    def __init__(self, watchers=()) -> None:
        super().__init__()
        self.nodes: list = []  # (strong references, for the block's one re-run)
        self._unit: list = []  # tanh/sigmoid/erf values, strictly inside (-1, 1)
        self.complements: list = []  # nodes of 1 + y of those, and positive multiples
        # the bound above each one's values in exact arithmetic (c + y < c + 1, times a
        # positive scale): at most 1 for a normal cdf 0.5 (1 + erf(z / sqrt 2)), whose 1 - cdf
        # is then a complement rounded to 0 (a Tobit's log(1 - Phi(z)) at a large z)
        self.bounds: list[float] = []
        # other watchers of the same ops (replay.off_graph_positive): one mode only, as a
        # second one's frames between torch's would hide the user's line (replay.source)
        self.watchers = list(watchers)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for watcher in self.watchers:
            watcher(func, args, kwargs, out)
        if getattr(func, "__name__", "") == "softmax" and args \
                and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(dim, int) and _two_entries(args[0], dim):
                self.nodes.append(out.grad_fn)
        self._note_complement(getattr(func, "__name__", ""), args, kwargs, out)
        return out

    def _note_complement(self, name: str, args, kwargs, out) -> None:
        """Note the nodes of ``1 + y`` of a y tanh/sigmoid/erf made in the block, and of its
        positive multiples: above 0 in exact arithmetic (a normal cdf 0.5 (1 + erf(x)), which
        the graph alone cannot tell from y + c, its scalars not kept)."""
        if not isinstance(out, torch.Tensor) or out.grad_fn is None or kwargs:
            return
        if name in _UNIT:
            self._unit.append(out)
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        scalars = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        if len(tensors) != 1 or len(scalars) != 1:
            return
        t, c = tensors[0], scalars[0]
        if name in _ADD and c >= 1 and any(t is u for u in self._unit):
            self.complements.append(out.grad_fn)
            self.bounds.append(c + 1)
        elif name in _SCALE and c > 0 and (k := next((i for i, n in enumerate(self.complements)
                                                     if t.grad_fn is n), None)) is not None:
            self.complements.append(out.grad_fn)
            self.bounds.append(self.bounds[k] / c if name in ("div", "__truediv__")
                               else self.bounds[k] * c)

    def complement_at(self, node) -> bool:
        """``node`` took ``1 - y`` (``rsub``) of such a softmax, or of tanh/sigmoid/erf, or
        a noted ``1 + y`` of the latter (M3's log Φ written with erf)."""
        if any(fn is n for fn in _nexts(node) if fn is not None for n in self.complements):
            return True
        for fn in _nexts(node):
            if fn is not None and node_op(fn) == "Rsub":
                made = [g for g in _nexts(fn) if g is not None]
                if made and (any(g is n for g in made for n in self.nodes)
                             or made_unit(made[0]) or self._below_one(made[0])):
                    return True
        return False

    def _below_one(self, fn) -> bool:
        """Node ``fn`` made a noted ``c (1 + y)`` whose values stay below 1 (a normal cdf)."""
        return any(fn is n and b <= 1 for n, b in zip(self.complements, self.bounds))


def _two_entries(x, dim: int) -> bool:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.is_floating_point():
        return False
    with torch.no_grad():
        if bool((x.isnan() | (x == float("inf"))).any()):
            return False
        return bool(((x > float("-inf")).sum(dim) >= 2).all())


def _nexts(node) -> list:
    try:
        return [fn for fn, _ in node.next_functions]
    except Exception:  # not an autograd node, or one that cannot say
        return []


def recause(cause: Cause, node: str, complement: bool, saved_zero: str | None) -> Cause:
    """``cause`` of backward origin ``node``, or ``precision`` when the 0 at its pole was such
    a complement (the float64 re-run rounds it to 1 too, so it read as ``invalid``; where
    float64 keeps it, the cause is ``precision`` already)."""
    if not complement or saved_zero != "0" or cause.name != "invalid":
        return cause
    return Cause("precision", hint(f"{node} made a non-finite gradient at its input's 0, the "
                                   "pole of its derivative"))
