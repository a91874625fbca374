"""Whether a unit-edge pole of a backward node (acos, asin, atanh, erfinv at +-1, acosh at 1)
is reached in exact arithmetic, or only by the step's rounding.

The node saved an input of exactly +-1 (``replay.backward.saved_facts``' ``"1"``), where its
derivative is infinite. The float64 re-run of the step says whether exact arithmetic puts the
input there too, but float64 rounds as well: a unit vector's cosine with itself is 1 in exact
arithmetic, and 1 or 1 - 2**-53 in float64 by the luck of its kernels' summation order (the
CPU's vector width: AVX2, AVX-512, NEON and scalar kernels differ). So the float64 value is
compared with the edge under a tolerance of float64 noise (:data:`NOISE`): within it, the
edge is the exact value and float64 missed it by rounding (``invalid``); beyond it, values
that differ in exact arithmetic rounded onto the edge in the step's type (``precision``: two
distinct unit vectors, 1 - 1e-8 apart, whose float32 cosine is 1).

The float64 input is the op's own input in that re-run: every call of the forward op
(``aten.acos``) is captured and the one matching the node's saved input (its shape, nearest
in value) read at the entries the node saved at the edge.
"""

from __future__ import annotations

import torch

from .compat import TorchDispatchMode, writes_arguments
from .dispatch import clone_args, float_leaves, run_op
from .float64_step import in_float64
from .rerun import Runner

__all__ = ["NOISE", "edge_input", "float64_gap", "reached"]

# float64 noise at the edge's scale (1): 32 ulps of float64 at 1 (7e-15), above what a float64
# normalisation and a dot product of thousands of terms round (a unit vector's cosine with
# itself: 1 ulp off, on the kernels that miss), below what a value differing from the edge in
# exact arithmetic yet rounding onto it in float32 is apart (tanh(16): 1 - 2.5e-14)
NOISE = 2.0 ** -47


def edge_input(saved: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The first of a node's saved tensors with an entry at +-1 (its input there), a copy."""
    return next((t.detach().clone() for t in saved or ()
                 if t.is_floating_point() and bool((t.abs() == 1).any())), None)


class _Calls(TorchDispatchMode):
    """Keeps the first input of every call of op ``name`` (and its in-place form) made inside
    it, as it was before the op ran, in float64."""

    def __init__(self, name: str):
        super().__init__()
        self.names = {name, name + "_"}
        self.inputs: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = func.overloadpacket.__name__ in self.names
        given = clone_args(args, kwargs) if hit and writes_arguments(func) else (args, kwargs)
        if hit and (ins := float_leaves(given[0][:1])):
            self.inputs.append(ins[0].detach().to(torch.float64))  # (data not yet widened)
        return run_op(func, args, kwargs)


def float64_gap(runner: Runner, node: str | None, saved: torch.Tensor | None) -> float | None:
    """How far from the edge, at the nearest, the float64 re-run puts the input of backward node
    ``node`` (``"AcosBackward0"``) at the entries where its saved input ``saved`` is +-1;
    None when that cannot be told (no node, no call of its op matching the input, a run that
    fails in float64)."""
    name = node.partition("Backward")[0].lower() if node and "Backward" in node else None
    if name is None or saved is None:
        return None
    calls = _Calls(name)
    try:
        with in_float64(runner, torch.get_default_dtype()), calls:
            run = runner.run(backward=False, instrument=False)
    except Exception:  # (the model refuses float64: the re-run that decided already said so)
        return None
    if run.error is not None and not calls.inputs:
        return None
    want = saved.detach().to(torch.float64)
    same = [t for t in calls.inputs if t.shape == want.shape]
    if not same:
        return None
    nearest = min(same, key=lambda t: float((t - want).abs().nan_to_num(float("inf")).max()))
    at = want.abs() == 1  # (the nearest of them: one exact there is a pole in exact arithmetic)
    return float((nearest[at] - want[at]).abs().min())


def reached(gap: float | None) -> bool:
    """Whether a float64 distance ``gap`` to the edge is rounding noise: the edge is exact."""
    return gap is not None and gap <= NOISE


def unit_pole(op: str, name: str, fn: str, dtype: str, edge: str, advice: str, still: bool,
              gap: float | None) -> tuple[str, str]:
    """The cause and the hint of ``op`` (of forward op ``name``) given exactly ``edge``, the
    edge of its domain, where ``fn`` is infinite; ``still``: non-finite in float64 too,
    ``gap``: the float64 input's distance to the edge (:func:`float64_gap`)."""
    if still:
        return "invalid", (f"{op} made a non-finite gradient from finite incoming gradients, "
                           f"in float64 too: its input is exactly {edge}, the edge of {name}'s "
                           f"domain, where {fn} is infinite; " + advice)
    if reached(gap):
        return "invalid", (f"{op} made a non-finite gradient from finite incoming gradients: "
                           f"its input is exactly {edge} in exact arithmetic, the edge of "
                           f"{name}'s domain, where {fn} is infinite (float64 puts it "
                           f"{gap:.1g} from it, rounding noise: a value compared with itself, "
                           "such as a unit vector's cosine with itself); " + advice)
    # a cosine of (nearly) parallel unit vectors rounded to exactly 1 (an ArcFace margin's
    # acos): float64 rounds it elsewhere, which is luck, not a fix
    return "precision", (f"{op} made a non-finite gradient in {dtype}: its input rounded to "
                         f"exactly {edge}, the edge of {name}'s domain, where {fn} is infinite "
                         "(finite in float64, whose rounding stopped short of it); " + advice)
