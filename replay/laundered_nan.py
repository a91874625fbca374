"""A NaN of the batch that fake quantization turned into a number.

``torch.fake_quantize_per_tensor_affine`` (and the per-channel and fused-observer kernels of
quantization-aware training) round a NaN to the zero point's level and clamp +-inf to the
grid's ends: the model's outputs, loss and gradients stay finite, as if the model imputed the
value on purpose. The recorder's advice for such a step (``allow_nan``) then hides a bad
record that the model trains on as a made-up number; a model with fake quantization enabled
is told so, and the record is to be fixed.
"""

from __future__ import annotations

import torch

__all__ = ["fake_quant_modules", "laundered_hint"]

_BASE = ("torch.ao.quantization", "FakeQuantizeBase")


def fake_quant_modules(model: torch.nn.Module | None) -> list[str]:
    """The names of ``model``'s fake-quantize modules whose fake quantization is on (no
    import of ``torch.ao.quantization``, deprecated: told by their class's bases)."""
    if model is None:
        return []
    out = []
    for name, m in model.named_modules():
        if any(c.__name__ == _BASE[1] and c.__module__.startswith(_BASE[0])
               for c in type(m).__mro__):
            on = getattr(m, "fake_quant_enabled", None)
            if not isinstance(on, torch.Tensor) or bool(on.flatten()[:1].all()):
                out.append(name)
    return out


def laundered_hint(model: torch.nn.Module | None, name: str) -> str | None:
    """The hint of an input event whose NaN in root input ``name`` left everything else
    finite, in a model with fake quantization on; None for another model."""
    fq = fake_quant_modules(model)
    if not fq:
        return None
    more = f" and {len(fq) - 1} more" if len(fq) > 1 else ""
    return (f"the model's outputs, loss and gradients stayed finite, but the model fake-"
            f"quantizes ({fq[0]}{more}), "
            "which rounds a NaN to the zero point's level (and +-inf to the grid's ends): "
            "unless its forward imputes the NaN before that, these samples trained as a "
            f"made-up number: fix or filter them (allow_nan=[{name!r}] would hide them)")
