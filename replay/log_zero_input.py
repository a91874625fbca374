"""An input event on a batch tensor whose non-finite values are all -Inf (no NaN, no +Inf): the
likeliest maker is a log of 0 in the data pipeline. A log feature of silence or zero padding (a
log-mel or log-power spectrogram of a clip padded to the batch's length, a log of a count of 0)
is -inf exactly, and little else a pipeline does makes -inf alone; the generic data-pipeline
hint (bad files, a std of 0) does not say where to look."""

from __future__ import annotations

import torch

from recorder.finite import has_nan

LOG_ZERO = ("{tensor} holds -Inf and no NaN or +Inf, which log(0) makes: a log feature the "
            "data pipeline computed without a floor (a log-mel or log-power spectrogram of "
            "silence or of a clip's zero padding, the log of a count or probability of 0): "
            "clamp before the log (torch.log(x.clamp_min(1e-5)), log(x + eps)), or mask the "
            "padded frames. If no log made it: ")


def log_zero_lead(t: torch.Tensor | None, tensor: str, hint: str) -> str:
    """``hint`` led by log(0) when ``t`` is floating and holds -Inf and nothing else
    non-finite; else ``hint`` unchanged."""
    if t is None or not t.is_floating_point() or has_nan(t):
        return hint
    if not bool((t == float("-inf")).any()) or bool((t == float("inf")).any()):
        return hint
    return LOG_ZERO.format(tensor=tensor) + hint
