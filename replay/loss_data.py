"""What a loss did with its data, said in the hint once the report is made: a NaN the loss
made that a mask's 0 then met (``replay.masked_after``), an overflow of an op that took the
loss's data alone (``replay.data_overflow``)."""

from __future__ import annotations

from typing import Any

from .data_overflow import data_overflow_hint
from .load import Step
from .masked_after import masked_after_hint


def loss_data_hints(report: dict[str, Any], step: Step) -> None:
    masked_after_hint(report, step)  # (an invisible keypoint's 0/0, weighted by 0 after)
    data_overflow_hint(report, step)  # (a loss's pow of its targets alone: 0..255 heatmaps)
