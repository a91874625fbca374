"""A division by zero whose zero comes from the model's own state, all 0 as the step began.

A hand-written spectral norm keeps its power iteration's vector ``u`` in a buffer (or a
parameter without gradient); started at zeros instead of a random unit vector, every iteration
keeps it 0 (``W^T 0 = 0``, normalised with an eps: 0), so sigma is 0 and ``w / sigma`` infinite.
An eps on that divisor, the usual remedy, would multiply the layer by 1/eps instead: the fix is
to start the state nonzero. Told apart by one forward more: with the state filled with random
values as the origin's module call begins, that call is finite. Only the origin module's own
buffers and parameters are tried. A trained parameter all 0 is a layer initialised to zeros
(AF2's structure module zero-initialises its backbone update, ``init="final"``; predicting
all four quaternion components and dividing them by their norm is then 0/0 at the first
step): an eps is the fix where a 0 result is fine (a normalised row of zeros), but where the
result must be a unit vector it keeps it 0 in every sample (a quaternion of 0 is no rotation),
so the hint says both. Only for a division of values per sample: not of the weights (a
zero-initialised layer's ``w / sigma`` under a spectral norm), where an eps keeps the layer at
0, the eps's to handle.
"""

from __future__ import annotations

import contextlib

import torch

from recorder.compat import is_norm_layer
from recorder.finite import finite

from .equal_spread import EQUAL_TERMS, equal_spread_hint
from .errors import StopRun
from .rerun import Runner
from .zero_statistic import zero_statistic_hint

# ops whose non-finite result comes from a 0 divisor
_DIVIDES = {"aten.div", "aten.reciprocal", "aten.rsqrt"}


def zero_state_hint(runner: Runner, origin, hit, samples=None) -> str | None:
    """The hint for an ``invalid`` division in ``origin`` (its module, call and micro-batch)
    that state of that module all 0 made (see the module doc), else None. ``samples``: the
    batch's (its ``size``), to tell a layer of zeros (every sample at the pole) from a zero
    bias that some samples' zero inputs put there."""
    if hit is None or hit.op not in _DIVIDES or runner.model is None:
        return None
    try:
        module = runner.model.get_submodule(origin.module)
    except AttributeError:
        return None
    prefix = f"{origin.module}." if origin.module else ""
    runner.reset()  # (the state as the step began: a forward that updates it ran since)
    # (not a norm layer's running statistics: running_mean starts at 0 by design)
    state = [(f"buffer {prefix}{sub}{'.' if sub else ''}{n}", t)
             for sub, m in module.named_modules() if not is_norm_layer(m)
             for n, t in m.named_buffers(recurse=False)] + \
        [(f"parameter {prefix}{n} (no gradient)", p) for n, p in module.named_parameters()
         if not p.requires_grad]
    # (a layer's output per sample, not a weight divided by its own norm: w / sigma)
    trained = [(f"parameter {prefix}{n}", p) for n, p in module.named_parameters()
               if p.requires_grad] if hit.rows else []
    # (judged all 0 before any trial, whose forward may update the state; a scalar state
    # only when the forward makes it a statistic, not a flag: see _statistics)
    zero = [(what, t) for what, t in state + trained if t.is_floating_point()
            and t.numel() > 1 and not t.any()]
    zero += _statistics(runner, [(what, t) for what, t in state if t.is_floating_point()
                                 and t.numel() == 1 and not t.any()])
    for what, t in zero:
        if finite_without_zeros(runner, origin, module, t):
            if t.requires_grad:  # (a layer the optimizer trains: initialised to zeros)
                if some_rows(hit.rows, samples):
                    return ZERO_IN_SOME_ROWS.format(op=hit.op, what=what, rows=hit.rows)
                # (a layer at any constant still leaves the compared values equal: other
                # parameters started alike, ka = ke in a Bateman function, are the pole)
                if not _finite_with(runner, origin, module, t, torch.ones_like(t)):
                    if bias := _zero_bias(runner, origin, module, t, (what, prefix), zero):
                        return ZERO_BIAS.format(op=hit.op, what=what, bias=bias)
                    return EQUAL_TERMS.format(op=hit.op, what=what)
                return ZERO_LAYER.format(op=hit.op, what=what)
            # (state the forward fills from a zero-initialised weight: an FP8 amax history)
            if stat := zero_statistic_hint(hit.op, what, module, prefix, lambda p: (
                    finite_without_zeros(runner, origin, module, p))):
                return stat
            if t.numel() == 1:  # (a scalar state: a running statistic, not a vector)
                return ZERO_SCALAR_STATE.format(op=hit.op, what=what)
            # (a std of gaps from a zero timestamp state: equal, not zero, values are the pole)
            if spread := equal_spread_hint(hit.op, what, lambda t=t: _finite_with(
                    runner, origin, module, t, torch.ones_like(t))):
                return spread
            return (f"{hit.op}'s divisor comes from {what}, all 0 as the step began: with "
                    "random values in its place the call is finite. A state vector started at "
                    "zeros (a power iteration's u, which every iteration keeps at 0, normalised "
                    "with an eps or not) makes the divisor 0, and an eps on the divisor would "
                    "scale the layer up by 1/eps instead; start it nonzero (torch.randn, "
                    "normalised)")
    return None


ZERO_SCALAR_STATE = (
    "{op}'s divisor comes from {what}, 0 as the step began: with another value in its place "
    "the call is finite, so no sample is to blame. A running statistic the model keeps (a "
    "variance or scale it updates as it trains) started at 0 is 0 when the first step "
    "divides by it, before any update: start it where a divisor is neutral (1, as "
    "BatchNorm's running_var), divide by it only once it has been updated, or add an eps "
    "where it is used (var + eps)")


def some_rows(rows: list[int] | None, samples) -> bool:
    """Did the pole hold in some samples of the batch only (the others finite with the same
    zero parameter)?"""
    size = getattr(samples, "size", None)
    return bool(rows) and bool(size) and len(rows) < size


# (StyleGAN2's demodulation without its eps: a style affine whose bias started at 0 gives a
# style of 0 to a sample whose w is 0, and only that sample's rsqrt is of 0)
ZERO_IN_SOME_ROWS = (
    "{op}'s divisor is 0 in samples {rows} only, and comes from {what}, all 0 as the step "
    "began: with random values in its place the call is finite. The other samples' divisors "
    "were not 0 with that same parameter, so it is no layer of zeros: those samples' own "
    "values into the layer (a latent or feature of 0) give 0 through it. Add an eps to the "
    "divisor (rsqrt(x + 1e-8)), and start that parameter where the divisor cannot be 0 for "
    "any input (a modulation's bias at 1)")


ZERO_LAYER = (
    "{op}'s divisor comes from {what}, all 0 as the step began: with random values in its "
    "place the call is finite. A layer of zeros (zero-initialised: AF2's init='final') "
    "outputs 0 for every input, and dividing that output by its own norm or spread is 0/0. "
    "Where the result must be a unit vector (a direction, a quaternion made a rotation), an "
    "eps on the divisor keeps it 0 in every sample, no unit vector (a quaternion of 0 is no "
    "rotation): give the vector a fixed nonzero part before normalising (the identity: "
    "OpenFold's quaternion (1, b, c, d)), or initialise that layer with small random values; "
    "where 0 is a fine result (a normalised row of zeros), add the eps to the divisor")


def _statistics(runner: Runner, scalars: list) -> list:
    """Of the scalar states all 0 as the step began, those the step's forward sets to a value
    other than a flag's 0 or 1 (a running variance, not a data-dependent init's float
    ``initialized``, whose trial value would skip the init instead of standing in for a
    statistic); the re-run is reset to the step's start after the one forward this takes."""
    if not scalars:
        return []
    runner.run(backward=False, instrument=False)
    kept = [(what, t) for what, t in scalars if float(t) not in (0.0, 1.0)]
    runner.reset()
    return kept


def finite_without_zeros(runner: Runner, origin, module, t: torch.Tensor) -> bool:
    """One forward with ``t`` filled with random values at each call of ``module`` (the
    re-run's reset puts it back): is the origin's call finite?"""
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0)).to(t)
    # (positive values too: a state the forward takes the sqrt or log of, a variance)
    return _finite_with(runner, origin, module, t, noise) or \
        _finite_with(runner, origin, module, t, noise.abs() + 0.5)


def _zero_bias(runner: Runner, origin, module, t: torch.Tensor, named, zero) -> str | None:
    """The name of a trained parameter of ``t``'s own layer (its bias), all 0 too, with which
    at random values and ``t`` at ones the origin's call is finite, while the module's other
    trained parameters moved apart leave it non-finite: the layer's outputs are equal because
    both its weight and its bias started at 0, the bias the part that sets them apart (an
    STN's head started at weight 0 and a bias of 0 instead of the identity), not parameters
    outside it started alike (a Bateman function's ka = ke, fed a zero random-effects
    head). ``named``: ``t``'s name and the module's prefix."""
    what, prefix = named
    layer = what.rsplit(".", 1)[0]
    g = torch.Generator().manual_seed(0)
    for other, p in zero:
        if p is t or not p.requires_grad or other.rsplit(".", 1)[0] != layer:
            continue
        noise = torch.randn(p.shape, generator=g).to(p)
        if not _finite_with(runner, origin, module, t, torch.ones_like(t), ((p, noise),)):
            continue
        kept = [q for n, q in module.named_parameters()
                if q.requires_grad and f"parameter {prefix}{n}".rsplit(".", 1)[0] != layer]
        moved = [(q, q.detach() * (1 + 0.1 * torch.randn(q.shape, generator=g).to(q))
                  + 0.01 * torch.randn(q.shape, generator=g).to(q)) for q in kept]
        equal = not _finite_with(runner, origin, module, t, torch.zeros_like(t),
                                 [(p, torch.zeros_like(p)), *moved])
        if equal:
            return other.removeprefix("parameter ")
    return None


# (a layer of zeros whose bias is 0 too: its outputs are all equal, 0, whatever its weight)
ZERO_BIAS = (
    "{op}'s divisor is 0 in every sample because the values it compares are equal: they come "
    "from {what} and {bias}, both all 0 as the step began, so that layer outputs 0 in every "
    "sample (a matrix it predicts is the zero matrix, singular: its determinant is 0); with "
    "the weight at a constant the outputs are still all equal, but with {bias} at random "
    "values the call is finite: a layer zero-initialised to start the model at a fixed "
    "output needs that output in its bias (a spatial transformer's localisation head: weight "
    "0, bias the identity transform [1, 0, 0, 0, 1, 0]), not 0")


def _finite_with(runner: Runner, origin, module, t: torch.Tensor, noise, also=()) -> bool:
    state = {"calls": 0, "finite": False}

    def pre(m, args):
        with torch.no_grad():
            t.copy_(noise)
            for other, value in also:
                other.copy_(value)

    def post(m, args, out):
        if runner.micro_batch != origin.micro_batch:
            return
        if state["calls"] == origin.call:
            state["finite"] = all(finite(o) for o in _tensors(out))
            raise StopRun
        state["calls"] += 1

    with put_back([t, *(other for other, _ in also)]):
        runner.run(backward=False, instrument=False,
                   hooks=lambda model: [module.register_forward_pre_hook(pre),
                                        module.register_forward_hook(post)])
    return state["finite"]


def run_with_random(runner: Runner, p: torch.Tensor, backward: bool):
    """A re-run of the step with ``p`` (a weight all 0) at small random values from every
    forward on, put back after (see :func:`put_back`)."""
    noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p) * 0.1

    def fill(m, args):
        with torch.no_grad():
            p.copy_(noise)

    with put_back([p]):
        run = runner.run(backward=backward, instrument=False,
                         hooks=lambda model: [model.register_forward_pre_hook(fill)])
    runner.reset()
    return run


@contextlib.contextmanager
def put_back(tensors):
    """Inside the block a trial may fill ``tensors`` (the model's): after it, their values
    as it began. The re-run's reset restores buffers and frozen parameters, not trained
    ones (a re-run of the step never writes them), so a trial's values would stay in a
    trained weight for every later trial and re-run of the replay."""
    saved = [(t, t.detach().clone()) for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):  # (DETR's {"pred_logits": ..., "aux_outputs": [...]})
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []
