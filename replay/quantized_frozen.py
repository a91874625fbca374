"""A frozen quantized weight non-finite as the step began: QLoRA's int8 base weight, held in a
wrapper tensor subclass (``recorder.wrapped``), its float ``scale`` holding a NaN.

The frozen-parameter advice (``replay.param_writes``) is for a momentum/EMA target: "the
loop's own update wrote them" and a multiplicative update's 0/0. Nothing updates a quantized
base weight: no gradient, no optimizer, and an EMA does not keep its values in int8 and a
scale. It arrived non-finite: loaded so (a quantized checkpoint), quantized so (an absmax
scale of an all-zero block, 0 / 0 in the quantizer's w / scale; a scale from non-finite float
weights), or, found mid-run, re-quantized or overwritten between steps (adapters merged into
the base and quantized again, a load_state_dict, a write into an inner tensor).
"""

from __future__ import annotations

from .wrapped_load import non_finite_inner, wrapped_entry

__all__ = ["quantized_frozen_hint"]


def quantized_frozen_hint(step, bad: list[str], names: str, held: str, first: bool
                          ) -> str | None:
    """The hint for frozen parameters ``bad`` that were all wrapper-subclass tensors in the
    run, one of their inner tensors non-finite (``first``: at the first step the recorder
    saw); None when any is a plain tensor."""
    entries = [wrapped_entry(step, f"weights/{n}") for n in bad]
    if not bad or any(e is None for e in entries):
        return None
    inner = next((f"{n}'s inner tensor {said}" for n in bad
                  if (said := non_finite_inner(step, f"weights/{n}")) is not None), None)
    classes = ", ".join(sorted({str(e.get("class")) for e in entries}))
    when = ("it was non-finite at the first step the recorder saw: it arrived so, " if first
            else "it turned non-finite between steps with no update of its own: it was put "
            "there (a re-quantization: adapters merged into the base and quantized again; a "
            "load_state_dict, a write into its inner tensors), ")
    return (f"{names} require no gradient and {held}, and are quantized ({classes}, a tensor "
            f"subclass dequantized from its inner tensors" + (f"; {inner}" if inner else "")
            + "): a frozen base weight, which no optimizer, gradient or EMA update writes; "
            f"{when}loaded or quantized that way: a quantized checkpoint holding NaN, or the "
            "quantizer's absmax scale of an all-zero block (w / scale is 0 / 0 there) or of "
            "non-finite float weights. Check each inner tensor where the weight is quantized "
            "or loaded (torch.isfinite(w.scale).all()), floor the quantizer's scale "
            "(absmax.clamp_min(eps)), and quantize again from finite float "
            "weights or load a finite checkpoint; no learning rate or eps of the training "
            "changes it")
