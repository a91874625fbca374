"""The weights an optimizer event's update made non-finite, told from the others the bundle
holds non-finite. The recorder reads an update's evidence when the next step closes and
writes that step's state: in a loop with several optimizers (DreamerV3's world model, actor
and critic), the others have by then stepped on what the bad update broke, and their weights
are no work of the recorded optimizer, which does not even hold them."""

from __future__ import annotations

from .load import Step


def update_params(step: Step, bad_weights: list[str]) -> tuple[list[str], list[str]]:
    """(the event's parameters the bundle holds non-finite, or all of the event's; the other
    non-finite ones). Every bad weight is the update's when the event lists none."""
    listed = list(step.event.get("params") or ())
    if not listed:
        return bad_weights, []
    return ([n for n in bad_weights if n in listed] or listed,
            [n for n in bad_weights if n not in listed])


def others_note(step: Step, others: list[str]) -> str | None:
    """The note on non-finite weights the recorded update did not make."""
    if not others:
        return None
    opt = step.meta.get("optimizer") or {}
    held = {n for g in opt.get("param_groups") or [] for n in g.get("params") or []}
    names = ", ".join(others[:3]) + (f" (+{len(others) - 3} more)" if len(others) > 3 else "")
    whose = ("which the recorded optimizer does not hold" if not held & set(others)
             else "which the recorder's check of this update found finite")
    return (f"{len(others)} more parameter(s) are non-finite in the bundle ({names}), {whose}: "
            "the bundle holds the state of the step after the update, in which another "
            "optimizer's step() or the loop's own update (an EMA target) wrote them, most "
            "likely from values this update broke; they are not this update's")
