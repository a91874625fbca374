"""The process-wide switches that change what a step computes, read once when a bundle is
written (never per step) for the replay to set again (``replay.switches``).

A training script sets them once at the top: ``torch.set_default_dtype(torch.float64)`` (its
tensors made inside ``forward`` and the factory's weights are float64), ``set_flush_denormal``
(a subnormal product is 0, so the division after it meets 0/0), deterministic mode (``torch.empty``
is filled with NaN), the float32 matmul and convolution precision (oneDNN computes in bf16 on CPU,
TF32 on CUDA), oneDNN on or off (another convolution kernel, another rounding) and opt_einsum (another
contraction order). A fresh replay process has torch's defaults, and the step's NaN would not come
back.
"""

from __future__ import annotations

from typing import Any

import torch

# the backends whose float32 precision ``torch.backends.<path>.fp32_precision`` sets, parents
# first: a child's "none" means its parent's
FP32_PRECISION_PATHS = ("", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn",
                        "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn")


def fp32_backend(path: str) -> Any:
    """``torch.backends`` or the backend under it at ``path`` (``"mkldnn.matmul"``); None
    where this torch has no such backend."""
    node: Any = torch.backends
    for part in filter(None, path.split(".")):
        node = getattr(node, part, None)
    return node if isinstance(getattr(node, "fp32_precision", None), str) else None


def fp32_precisions() -> dict[str, str]:
    """Each backend's float32 precision (``torch.set_float32_matmul_precision("medium")`` sets
    ``mkldnn.matmul`` to ``bf16`` and ``cuda.matmul`` to ``tf32``), by path."""
    out = {}
    for path in FP32_PRECISION_PATHS:
        backend = fp32_backend(path)
        if backend is not None:
            out[path] = backend.fp32_precision
    return out


def matmul_precision() -> str | None:
    """``torch.get_float32_matmul_precision()`` ("highest", "high", "medium"); None where torch
    refuses to say (the run set some backends' precision by the newer API) or has no getter."""
    try:
        return torch.get_float32_matmul_precision()
    except (RuntimeError, AttributeError):
        return None


def flush_denormal() -> bool:
    """Whether ``torch.set_flush_denormal(True)`` is on in this thread (torch has no getter):
    half of float32's smallest normal number is 0 only when subnormals flush. On the CPU, in
    float32 whatever the default dtype; it draws no random number."""
    with torch.no_grad():
        tiny = torch.tensor([1e-38], dtype=torch.float32, device="cpu")
        return bool((tiny * 0.5).item() == 0)


def numeric_switches() -> dict[str, Any]:
    """The ``env`` fields of the switches above, as this process has them now."""
    opt_einsum = torch.backends.opt_einsum
    fill = getattr(torch.utils, "deterministic", None)
    return {
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": bool(getattr(fill, "fill_uninitialized_memory", True)),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "flush_denormal": flush_denormal(),
        "float32_matmul_precision": matmul_precision(),
        "fp32_precision": fp32_precisions(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "opt_einsum": {"enabled": bool(opt_einsum.enabled),
                       "strategy": opt_einsum.strategy if opt_einsum.is_available() else None},
    }
