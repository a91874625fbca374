"""Whether a unit-edge pole of a backward node (acos, asin, atanh, erfinv at +-1, acosh at 1)
is reached in exact arithmetic, or only by the step's rounding.

The node saved an input of exactly +-1 (``replay.backward.saved_facts``' ``"1"``), where its
derivative is infinite. The float64 re-run of the step says whether exact arithmetic puts the
input there too, but float64 rounds as well: a unit vector's cosine with itself is 1 in exact
arithmetic, and 1 or 1 - 2**-53 in float64 by the luck of its kernels' summation order (the
CPU's vector width: AVX2, AVX-512, NEON and scalar kernels differ). How far float64 is from
the edge cannot tell that apart alone: two distinct unit vectors a float32 rounding apart
(an ArcFace weight planted as a multiple of an embedding) have a cosine 1 - 1e-15, as far as
float64's noise over a long dot product. So the edge is exact where, in the float64 re-run,
the input is a comparison of equal things (``replay.equal_operands``: a dot of a vector with
itself, at the entries the node saved at the edge) and within float64's noise of the edge
(:data:`NOISE`): ``invalid``. Otherwise float64's finite step says rounding put distinct
values on the edge: ``precision``.

The float64 input is the op's own input in that re-run: every call of the forward op
(``torch.acos``) is captured with its autograd history, and the one matching the node's saved
input (its shape, nearest in value) read at the entries the node saved at the edge.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .equal_operands import equal_at
from .float64_step import in_float64
from .rerun import Runner

__all__ = ["NOISE", "edge_input", "exact_gap", "reached"]

# float64 noise at the edge's scale (1): 2**-40 is 4096 ulps of float64 at 1, far above what
# a float64 normalisation and a dot product of thousands of terms round (a few 1e-15 at most);
# with equal operands, a larger distance is no comparison of unit vectors (an unnormalised dot)
NOISE = 2.0 ** -40
_ALIASES = {"acos": "arccos", "asin": "arcsin", "atanh": "arctanh", "acosh": "arccosh"}


def edge_input(saved: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The first of a node's saved tensors with an entry at +-1 (its input there), a copy."""
    return next((t.detach().clone() for t in saved or ()
                 if t.is_floating_point() and bool((t.abs() == 1).any())), None)


class _Calls(TorchFunctionMode):
    """Keeps the first input of every call of op ``name`` (its in-place form, its alias) made
    inside it: its value before the op ran, in float64, and its autograd node."""

    def __init__(self, name: str):
        super().__init__()
        alias = _ALIASES.get(name, name)
        self.names = {name, name + "_", alias, alias + "_", "special_" + name}
        self.inputs: list[tuple[torch.Tensor, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if getattr(func, "__name__", None) in self.names and isinstance(x, torch.Tensor) \
                and x.is_floating_point():
            self.inputs.append((x.detach().to(torch.float64, copy=True), x.grad_fn))
        return func(*args, **kwargs)


def exact_gap(runner: Runner, node: str | None, saved: torch.Tensor | None) -> float | None:
    """How far from the edge the float64 re-run puts the input of backward node ``node``
    (``"AcosBackward0"``) at the entries where its saved input ``saved`` is +-1, where that
    input is a comparison of equal operands there; None where it is not, or where that cannot
    be told (no node, no call of its op matching the input, a run failing in float64)."""
    name = node.partition("Backward")[0].lower() if node and "Backward" in node else None
    if name is None or saved is None:
        return None
    calls = _Calls(name)
    try:
        with in_float64(runner, torch.get_default_dtype()), calls:
            runner.run(backward=False, instrument=False)
    except Exception:  # (the model refuses float64: the re-run that decided already said so)
        return None
    want = saved.detach().to(torch.float64)
    same = [c for c in calls.inputs if c[0].shape == want.shape]
    if not same:
        return None
    value, fn = min(same, key=lambda c: float((c[0] - want).abs().nan_to_num(2.0).max()))
    at = want.abs() == 1
    if not equal_at(fn, at):
        return None
    return float((value[at] - want[at]).abs().max())


def reached(gap: float | None) -> bool:
    """Whether a float64 distance ``gap`` to the edge is rounding noise: the edge is exact."""
    return gap is not None and gap <= NOISE


def unit_pole(op: str, name: str, fn: str, dtype: str, edge: str, advice: str, still: bool,
              gap: float | None) -> tuple[str, str]:
    """The cause and the hint of ``op`` (of forward op ``name``) given exactly ``edge``, the
    edge of its domain, where ``fn`` is infinite; ``still``: non-finite in float64 too,
    ``gap``: the float64 input's distance to the edge, of equal operands (:func:`exact_gap`)."""
    if still:
        return "invalid", (f"{op} made a non-finite gradient from finite incoming gradients, "
                           f"in float64 too: its input is exactly {edge}, the edge of {name}'s "
                           f"domain, where {fn} is infinite; " + advice)
    if reached(gap):
        return "invalid", (f"{op} made a non-finite gradient from finite incoming gradients: "
                           f"its input is exactly {edge} in exact arithmetic, the edge of "
                           f"{name}'s domain, where {fn} is infinite: it compares equal "
                           "operands there (a unit vector's cosine with itself), which float64 "
                           f"puts {gap:.1g} from it, rounding noise; " + advice)
    # a cosine of (nearly) parallel unit vectors rounded to exactly 1 (an ArcFace margin's
    # acos): float64 rounds it elsewhere, which is luck, not a fix
    return "precision", (f"{op} made a non-finite gradient in {dtype}: its input rounded to "
                         f"exactly {edge}, the edge of {name}'s domain, where {fn} is infinite "
                         "(finite in float64, whose rounding stopped short of it); " + advice)
