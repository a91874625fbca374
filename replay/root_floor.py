"""sqrt of a value rounding put below 0 whose exact value is 0 (a squared distance written
``|x|² + |y|² − 2 x·y`` between a point and its copy, a variance of equal values): clamped to
the domain's edge, as the precision advice says, it is sqrt(0), whose gradient is infinite, so
the backward makes the NaN the forward no longer does. The floor to advise is above 0."""

from __future__ import annotations


def advice(name: str, moved: tuple | None) -> str:
    """What to add to the advice for op ``name`` (``"sqrt"``) whose input float64 has as
    ``moved[2]`` (``replay.float64_inputs.moved``): a positive floor when that value is exactly 0."""
    if name != "sqrt" or moved is None or moved[2] != 0.0:
        return ""
    return ("; float64 has exactly 0 there, where sqrt's gradient is infinite: clamp to a "
            "small positive floor (d.clamp_min(1e-12).sqrt()), not to 0, or for a distance "
            "take the norm of the difference (torch.linalg.vector_norm(x - y, dim=-1), "
            "whose gradient at 0 is 0)")
