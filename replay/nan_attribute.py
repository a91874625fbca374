"""The attribute that holds the NaN number an op was given.

A number the loop computes and sets on the loss or a module each step (a KL warm-up weight
``min(1, epoch / n_warmup)`` with numpy scalars, ``n_warmup = int(0.1 * n_epochs) = 0``:
0/0 is NaN with a warning) reaches the op as a plain float; ``replay.literal_fill`` says a
NaN number made by Python or numpy arithmetic was given. The bundle holds the attributes as
the step had them (the loss's config, each module's changed attributes), so the hint names
the one that is NaN: that is where the user's schedule wrote it.
"""

from __future__ import annotations

from typing import Any

from .load import Step

_GIVEN = "was given NaN as a number"


def nan_attribute_hint(report: dict[str, Any], step: Step) -> None:
    """Append the loss's or modules' attributes the bundle holds as NaN to such a hint."""
    hint = report.get("hint") or ""
    if _GIVEN not in hint:
        return
    loss = step.meta.get("loss") or {}
    names = [f"the loss's {k}" for k, v in (loss.get("config") or {}).items() if v == "nan"]
    for info in step.meta.get("modules") or ():
        where = info.get("name") or "<root>"
        names += [f"{where}.{k}" for k, v in (info.get("attrs") or {}).items() if v == "nan"]
    if names:
        report["hint"] = (
            f"{hint}. At this step {', '.join(names)} {'is' if len(names) == 1 else 'are'} "
            "NaN, as the loop set it: look at the schedule that computes it (such as a "
            "fraction step / n_warmup with n_warmup = 0)")
