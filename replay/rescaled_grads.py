"""Loop-written gradients that are the backward's own, rescaled entry by entry, non-finite
where the scale's divisor was 0.

Full-waveform inversion divides the velocity gradient by the source illumination
``sum_t u²`` (a diagonal pseudo-Hessian) between ``backward`` and ``step``; Adagrad-like
scalings and a Gauss-Newton diagonal written by hand do the same. Where that divisor is 0 (a
cell the wavefield never reached, or squares of small snapshots kept in float16 that
underflowed to 0) the gradient becomes 0/0 or x/0 at those entries alone. The replay cannot
re-run the loop's code, but it can divide the recorded gradient by the re-run's: a factor
that varies from entry to entry (not one scalar: a clip or a normalisation by a norm) is a
diagonal preconditioner, and its non-finite entries are where its divisor was 0.
"""

from __future__ import annotations

import torch

from .load import Step

SPREAD = 1.5  # the least max/min ratio of the factors that makes them entrywise, not a scalar


def entrywise_divisor_text(step: Step, runner, params: list[str]) -> str:
    """The hint for a loop-written gradient of ``params[0]`` that is the re-run's times a
    positive factor varying per entry at its finite entries, non-finite at some others;
    ``""`` otherwise."""
    name = params[0] if params and runner is not None else None
    recorded = step.tensors.get(f"grads/{name}") if name else None
    if recorded is None or not recorded.is_floating_point() or not recorded.numel() \
            or bool(torch.isfinite(recorded).all()) or not bool(torch.isfinite(recorded).any()):
        return ""  # (every entry non-finite: a shared factor, replay.shared_factor)
    runner.run(instrument=False)
    g = dict(runner.model.named_parameters()).get(name)
    g = None if g is None else g.grad
    if g is None or g.shape != recorded.shape or not bool(torch.isfinite(g).all()):
        return ""
    g, r = g.detach().double(), recorded.detach().double()
    both = torch.isfinite(r) & (g != 0) & (r != 0)
    if int(both.sum()) < 2:
        return ""
    factor = r[both] / g[both]
    lo, hi = float(factor.min()), float(factor.max())
    if lo <= 0 or hi / lo < SPREAD:
        return ""  # (one scalar for all: a clip or a global normalisation)
    bad = ~torch.isfinite(r)
    zero, nonzero = int((bad & (g == 0)).sum()), int((bad & (g != 0)).sum())
    where = " and ".join(p for p in (
        f"0 at {zero} of them (0/0)" if zero else "",
        f"nonzero at {nonzero} (x/0)" if nonzero else "") if p)
    return (f"the loop's own code rescaled {name}'s gradient entry by entry between backward "
            f"and step(): at its finite entries the recorded gradient is the re-run's times "
            f"a factor from {lo:.3g} to {hi:.3g}, not one scalar (a diagonal preconditioner: "
            "an illumination or pseudo-Hessian, a per-entry normaliser written by hand), and "
            f"at {int(bad.sum())} of {r.numel()} entries it is non-finite, where the re-run's "
            f"gradient is {where}: the preconditioner's divisor is 0 there (a region its "
            "energy never reached, or small values it summed in float16 or bfloat16 that "
            "underflowed to 0); floor the divisor before dividing (diag + eps * diag.max(), "
            "diag.clamp_min(eps)) and accumulate it in float32")
