"""Anomaly mode's error: a loop run under ``torch.autograd.detect_anomaly()`` raises inside
backward at a node's NaN, before any reaches a gradient the recorder reads."""

from __future__ import annotations


def anomaly_reason(exc: BaseException) -> str | None:
    """``"anomaly"`` when ``exc`` is anomaly mode's error for a backward node that returned
    NaN (``set_detect_anomaly(True)``): it raises inside backward, before the NaN reaches a
    gradient the recorder reads, so the step's statistics alone would show nothing."""
    text = str(exc) if isinstance(exc, RuntimeError) else ""
    return "anomaly" if text.startswith("Function '") and " returned nan values in its " \
        in text else None
