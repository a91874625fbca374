"""The training process's numeric switches (:mod:`recorder.numeric_switches`), set again for the
replay's re-runs and put back after: a fresh replay process has torch's defaults (and the shell's
thread count), and a step whose NaN came from a sum's rounding, a flushed subnormal, a NaN-filled ``torch.empty``, a bf16 matmul or a float64
constant would not make it again. A bundle without a field leaves that switch as it is.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from recorder import numeric_switches as numeric

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
MATMUL = ("highest", "high", "medium")
STRATEGIES = ("auto", "greedy", "optimal")  # (opt_einsum's; torch takes any string)


@contextlib.contextmanager
def switches_as_recorded(meta: dict[str, Any]):
    env = meta.get("env") or {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_threads(env.get("num_threads")))
        stack.enter_context(_default_dtype(env.get("default_dtype")))
        stack.enter_context(_flush_denormal(env.get("flush_denormal")))
        stack.enter_context(_deterministic(env))
        stack.enter_context(_fp32_precision(env.get("float32_matmul_precision"),
                                            env.get("fp32_precision")))
        stack.enter_context(_mkldnn(env.get("mkldnn_enabled")))
        stack.enter_context(_opt_einsum(env.get("opt_einsum")))
        yield


@contextlib.contextmanager
def _threads(recorded: Any):
    """The intra-op thread count: a CPU reduction splits its sum by threads, so its rounding is
    the thread count's (torchrun's workers run with ``OMP_NUM_THREADS=1``; a shell's replay
    would use every core and sum differently)."""
    was = torch.get_num_threads()
    if isinstance(recorded, int) and recorded > 0 and recorded != was:
        torch.set_num_threads(recorded)
    try:
        yield
    finally:
        if torch.get_num_threads() != was:
            torch.set_num_threads(was)


@contextlib.contextmanager
def _default_dtype(name: Any):
    was = torch.get_default_dtype()
    if name in DTYPES:  # (the factory's weights and forward's own tensors take it)
        torch.set_default_dtype(DTYPES[name])
    try:
        yield
    finally:
        torch.set_default_dtype(was)


@contextlib.contextmanager
def _flush_denormal(recorded: Any):
    was = numeric.flush_denormal()
    if isinstance(recorded, bool) and recorded != was:
        torch.set_flush_denormal(recorded)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)


@contextlib.contextmanager
def _deterministic(env: dict[str, Any]):
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic
    was_fill = fill.fill_uninitialized_memory
    on, warn_only = env.get("deterministic_algorithms"), env.get("deterministic_warn_only")
    if isinstance(on, bool):
        torch.use_deterministic_algorithms(on, warn_only=warn_only is True)
    if isinstance(env.get("fill_uninitialized_memory"), bool):
        fill.fill_uninitialized_memory = env["fill_uninitialized_memory"]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        fill.fill_uninitialized_memory = was_fill


@contextlib.contextmanager
def _fp32_precision(legacy: Any, recorded: Any):
    was = numeric.matmul_precision(), numeric.fp32_precisions()
    _set_fp32(legacy, recorded if isinstance(recorded, dict) else {})
    try:
        yield
    finally:
        _set_fp32(*was)


def _set_fp32(legacy: Any, values: dict[str, Any]) -> None:
    """The legacy setter first, as the run used it (mixing in the backends' own setters makes
    ``torch.get_float32_matmul_precision()`` raise, which a model or Lightning may call), then
    each backend whose precision still differs."""
    if legacy in MATMUL and legacy != numeric.matmul_precision():
        torch.set_float32_matmul_precision(legacy)
    for path in numeric.FP32_PRECISION_PATHS:  # (parents first: a child's "none" is its parent's)
        backend, value = numeric.fp32_backend(path), values.get(path)
        if backend is None or not isinstance(value, str) or backend.fp32_precision == value:
            continue
        try:
            backend.fp32_precision = value
        except (RuntimeError, ValueError, AssertionError):
            pass  # (a value this torch does not know: the replay's default precision)


@contextlib.contextmanager
def _mkldnn(recorded: Any):
    was = torch.backends.mkldnn.enabled
    if isinstance(recorded, bool):
        torch.backends.mkldnn.enabled = recorded
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


@contextlib.contextmanager
def _opt_einsum(recorded: Any):
    einsum = torch.backends.opt_einsum
    was = (einsum.enabled, einsum.strategy if einsum.is_available() else None)
    if isinstance(recorded, dict) and isinstance(recorded.get("enabled"), bool):
        einsum.enabled = recorded["enabled"]
        if einsum.is_available() and recorded.get("strategy") in STRATEGIES:
            einsum.strategy = recorded["strategy"]
    try:
        yield
    finally:
        einsum.enabled = was[0]
        if was[1] is not None:
            einsum.strategy = was[1]


def flushed_note(step, report: dict[str, Any]) -> str | None:
    """An underflow in a run that flushed subnormals to 0 (``torch.set_flush_denormal(True)``,
    re-applied here): said, since IEEE arithmetic would have kept the value the flush made 0,
    and the switch is the run's, set once and far from the op."""
    if report.get("cause") != "underflow" or (step.meta.get("env") or {}).get(
            "flush_denormal") is not True:
        return None
    return ("the run flushes subnormal numbers to 0 (torch.set_flush_denormal(True)), and so "
            "did this replay: a value below the type's smallest normal number (1.2e-38 in "
            "float32) is 0 there where IEEE arithmetic keeps it, so the flush made the 0 the op "
            "met; the fix is the computation's scale (work in log space), not the switch alone")
