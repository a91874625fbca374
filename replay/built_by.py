"""The op of the factory's own code that made a parameter non-finite while the model was
built: 3DGS's initial log-scales ``torch.log(torch.sqrt(dist2))`` of a point duplicated in
the cloud (its nearest distance 0) without the reference's ``clamp_min(dist2, 1e-7)``. The
weights hint names it with its line instead of reading the value as an intended mask, which
is written as a literal (``torch.full(.., -inf)``, ``masked_fill(m, -inf)``) and so never an
op of finite inputs. A reduction of an empty tensor (fastText's out-of-vocabulary vector, the
mean of its known n-grams' vectors, when it has none) is named as such, not by its inputs'
lowest value (it has none). A NaN table made of an infinity (a RoPE table's
``1 / theta ** k`` of ``theta = 0``, then ``cos(t * inf)``) is named by the op that made the
infinity, no op having made NaN of finite values."""

from __future__ import annotations

import math

import torch

from recorder.finite import finite, kind_of

from .compat import TorchDispatchMode, tree_leaves
from .source import library_caller, user_source
from .uninitialised import Unwritten

# ops whose non-finite value from finite inputs is a pole or a domain's edge, not a result
# too large for the type
_POLES = {"log", "log2", "log10", "log1p", "div", "reciprocal", "rsqrt", "sqrt", "pow",
          "logit", "atanh", "acos", "asin", "xlogy"}


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class FirstMade(TorchDispatchMode):
    """Around a factory call: the first op that made a NaN/Inf of finite tensors and finite
    numbers, as ``found``: (op, kind made, smallest input, ``file:line``); and the
    allocations holding NaN (``torch.empty``'s under deterministic mode), as ``unwritten``."""

    def __init__(self):
        super().__init__()
        self.found: tuple[str, str, float, str | None] | None = None
        self.nan: tuple[str, str, float, str | None] | None = None  # (the first NaN's)
        self.unwritten = Unwritten()

    def first_of(self, kinds: set[str]):
        """The first op that made one of ``kinds``; for NaN that no op made of finite
        values, the first that made an infinity (later ops made the NaN of it)."""
        if self.found is not None and self.found[1] in kinds:
            return self.found
        return self.nan if "nan" in kinds and self.nan is not None else \
            self.found if kinds == {"nan"} else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.unwritten.allocated(name, out, f"aten.{name}", 0, 0, None)
        if self.found is None or self.nan is None and self.found[1] != "nan":
            self._look(func, (args, kwargs or {}), out)
        return out

    def _look(self, func, given, out) -> None:
        outs = [t for t in tree_leaves(out) if _floating(t) and not t.is_meta]
        made = next((k for k in map(kind_of, outs) if k is not None), None)
        if made is None:
            return
        leaves = tree_leaves(given)
        ins = [t for t in leaves if _floating(t)]
        # (a meta input has no values: ``to_empty``'s ``empty_like`` of one made memory, no op)
        if not ins or any(t.is_meta for t in ins) or not all(finite(t) for t in ins):
            return  # (a value carried from a literal: the literal is what wrote it)
        if any(isinstance(x, float) and not math.isfinite(x) for x in leaves):
            return  # a literal -inf (a mask value)
        low = min(float(t.detach().real.min()) for t in ins if t.numel()) \
            if any(t.numel() for t in ins) else math.nan
        src = user_source()
        hit = (f"aten.{func.overloadpacket.__name__}", made, low, src, library_caller(src))
        self.found = self.found or hit
        if made == "nan":
            self.nan = hit


def built_by_text(found, names: str, kinds: set[str]) -> str | None:
    """The hint's words for ``found`` when it made the kind the parameters hold."""
    if found is None or found[1] not in kinds and kinds != {"nan"}:
        return None
    op, made, low, src, caller = found
    at = f" at {src}" if src else ""
    at += f" (in a library, called from {caller})" if caller else ""
    if made not in kinds:  # (an infinity later ops turned into NaN: 0 * inf, cos(inf))
        at += ", which later ops turned into NaN (0 * inf, inf - inf, cos(inf)),"
    head = f"the factory builds {names} non-finite: {op}"
    tail = (f" made {made}{at} while the model was built, and no update or write of the loop "
            "made them. Fix that initialisation: ")
    if made != "nan" and low != 0 and op.removeprefix("aten.").rstrip("_") not in _POLES:
        return (head + tail + "its true result is too large for the type (an outlier "
                "among the values it starts from, a point far outside the others: drop or "
                "clamp it, or rescale before the op)")
    if math.isnan(low):  # (its inputs were all finite: none had an element)
        return (head + " of an empty tensor" + tail + "a reduction over no element is 0/0 (a "
                "mean of an empty selection: an out-of-vocabulary word's vector averaged over "
                "its known n-grams when none is known, a class centre over no sample): give "
                "such rows a fallback where they are made (a random or zero vector, a "
                "count clamped to 1) or check the selection is not empty")
    given = " of 0" if low == 0 else f" (inputs as low as {low:.3g})"
    if caller:  # (the library's transform of a value that line gave it)
        return (head + given + tail + f"the library computed it from a value {caller} gave "
                "it, outside the op's domain (a positive-constrained hyper-parameter, a "
                "lengthscale or a noise, set to 0: its raw parameter is the inverse transform, "
                "log(expm1(0)) = -inf): give that value inside the constraint's range (> 0)")
    return (head + given + tail + "keep the op's input in its domain (clamp a distance or a "
            "count away from 0 before a log or a division, as the value it starts from may "
            "be 0 for some rows of the data)")
