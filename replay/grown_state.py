"""A buffer the model carries across steps that had grown far past its built value before the
step (FORCE's recursive-least-squares inverse correlation matrix ``P``, divided by a
forgetting factor below 1 at every time step, growing in the directions the reservoir does not
excite). The overflow then ends a divergence of the model's own state, which the loss's jump
also shows; a smaller learning rate or clipping (the weights' remedy) does not reach it. The
bundle's buffers at the step's start are compared with the factory's."""

from __future__ import annotations

import math

import torch

GROWTH = 1e6  # the least ratio of the step-start absmax to the built one
# the weights' largest such ratio at which they count as grown too: the buffer may then only
# follow them (a running variance of activations a learning rate too high blew up)
WEIGHTS_GREW = 10.0


def _absmax(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _ratio_of(step, built: dict[str, torch.Tensor], prefix: str) -> float:
    """The largest step-start absmax over the built one among ``built``'s entries."""
    ratios = [_absmax(now) / was for name, b in built.items()
              if isinstance(now := step.tensors.get(f"{prefix}/{name}"), torch.Tensor)
              and now.shape == b.shape and (was := _absmax(b)) > 0]
    return max(ratios, default=0.0)


def grown_buffers(step) -> list[tuple[str, float, float]]:
    """(name, built absmax, step-start absmax) of each floating buffer whose finite values at
    the step's start are at least :data:`GROWTH` times its largest value in the factory's
    model, while the weights did not grow; empty without a factory or when it fails."""
    if step.rebuild is None:
        return []
    try:
        with torch.random.fork_rng(devices=[]):  # (the factory draws; the re-runs are done)
            model = step.rebuild()
    except Exception:  # (a factory needing what the replay lacks: no note, not a failure)
        return []
    if _ratio_of(step, dict(model.named_parameters()), "weights") >= WEIGHTS_GREW:
        return []
    out = []
    for name, b in dict(model.named_buffers()).items():
        now = step.tensors.get(f"buffers/{name}")
        if not isinstance(now, torch.Tensor) or not now.is_floating_point() \
                or now.shape != b.shape or not b.is_floating_point():
            continue
        was, grown = _absmax(b), _absmax(now)
        if was > 0 and math.isfinite(grown) and grown >= GROWTH * was:
            out.append((name, was, grown))
    return out


def grown_state_advice(step) -> str | None:
    """The growth hint's remedy when such a buffer is the state that diverged, else None."""
    found = grown_buffers(step)
    if not found:
        return None
    name, was, now = max(found, key=lambda f: f[2] / f[1])
    return (f"the buffer {name} held values up to {now:.3g} at the step's start, {now / was:.3g}x "
            f"its largest {was:.3g} when the model was built: state the model carries across "
            "steps grew (a recursive-least-squares P divided by a forgetting factor below 1, a "
            "running statistic fed back into the forward), which a smaller learning rate or "
            "clipping does not bound; bound it where the code writes it (a forgetting factor of "
            "1, the matrix symmetrised and reset when its trace grows, a clamp)")
