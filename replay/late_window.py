"""A rewind window whose copy was taken after the run had begun to grow.

``--try`` re-runs the window from its copy. When the precursors show the growth began before
that copy (a gradient norm jump at step 10 under ``rewind=1``, whose window starts at step 16),
every try starts from weights that growth had already reached: a try then says whether the
change rescues the run from there (a tenth of the rate, from weights already blown up, is
"still diverging"), not whether it would have kept the run finite, which is what the user
asks. The note says so once, with the ``rewind`` that would hold a copy from before it.
"""

from __future__ import annotations

from typing import Any

from .precursors import transient

# precursors of a run that grew (not one op's range)
GROWTH = {"loss_jump": "a loss jump", "grad_norm_jump": "a gradient norm jump",
          "weight_jump": "a weight jump", "lr_jump": "a learning-rate jump"}


def late_window_note(report: dict[str, Any], first_step: int) -> str | None:
    """The note for tries re-run from a window whose first step ``first_step`` came after the
    first growth precursor (one the run did not fall back from), None otherwise."""
    at = (report.get("event") or {}).get("step")
    hist = report.get("history") or {}
    began = next((p for p in report.get("precursors") or []
                  if p.get("kind") in GROWTH and isinstance(p.get("step"), int)
                  and p["step"] < first_step and not transient(hist, p)), None)
    if began is None or at is None:
        return None
    need = at - began["step"]
    return (f"the run began to grow at step {began['step']} ({GROWTH[began['kind']]}, see "
            f"precursors), before the window's copy at step {first_step}: every try starts "
            "from weights that growth had already reached, so it says whether the change "
            "rescues the run from there, not whether it would have kept it finite; record "
            f"with FlightRecorder(..., rewind=N), N of {need} or more, to try changes from "
            "before it")
