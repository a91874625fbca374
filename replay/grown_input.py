"""Out-of-scale input rows that grew over the steps before the event: a state the loop fed
back, no corrupt record.

A neural cellular automaton trained from a sample pool (``x = model(pool[idx], steps)``, then
``pool[idx] = x.detach()``), a rollout restarted from its last states: the model's own output
is the next step's batch, its only input. When the update lets the state grow, the rows that
grew fastest stand out of the batch and the outlier reading (:mod:`replay.outliers`) called
them corrupt records to drop. A corrupt record jumps the input's absmax at the step that
draws it; here the jump began at an earlier step and the input stayed above it, growing,
through the event's step (the :data:`replay.precursors.INPUT_JUMP` precursor says both).
"""

from __future__ import annotations

import re
from typing import Any

from .domains import g
from .precursors import INPUT_JUMP


def grown_input_note(report: dict[str, Any], rows: list[int], found: dict[str, Any]
                     ) -> str | None:
    """The sentence replacing the outlier hint when the input batch's absmax jumped at an
    earlier step and stayed above it through the event's step; None otherwise."""
    at = report["event"].get("step")
    for p in report.get("precursors") or []:
        d = p.get("detail") or ""
        through = re.search(r"above it through step (\d+)", d)
        if (p.get("kind") == "absmax_jump" and d.startswith(INPUT_JUMP) and through
                and at is not None and p.get("step", at) < at == int(through.group(1))):
            which = ",".join(str(r) for r in rows)
            return (f"sample(s) {which} of {found['tensor']} reach {g(found['value'])}, and "
                    f"the input batch's absmax had jumped already at step {p['step']} and "
                    "stayed above it through this one (see precursors): inputs that grow "
                    "step after step are a state the loop feeds back into the model (a sample "
                    "pool of its own outputs, a rollout restarted from its last state), no "
                    "records to drop; bound the state in the model (an alive mask, a clamp or "
                    "a normalisation of the update, a last layer initialised to zero) or "
                    "replace the pool samples that grew (with the seed)")
    return None
