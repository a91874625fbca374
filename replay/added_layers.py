"""A re-run that departs from the recording because the model gained parameters after the
recorder attached (the bundle's ``after_attach``, :mod:`recorder.added_params`): a block
appended, a head added, a ``weight_norm`` registered mid-run. The recorder neither hooked,
checked nor bundled them, so the replay's model is not the one that ran: said as such, with
the fix (attach again after changing the model), not as a factory building another model.
"""

from __future__ import annotations

from .load import Step

WHY = "the model gained parameters after the recorder attached, which the bundle does not hold"


def after_attach(step: Step) -> dict[str, list[str]] | None:
    """The bundle's ``{"added": [...], "gone": [...]}``, or None."""
    return step.meta.get("after_attach") or None


def names_text(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def text(found: dict[str, list[str]]) -> str:
    """The fidelity line's reason."""
    gone = found.get("gone")
    return (f"the model that ran had parameters the recorder did not hold ("
            f"{names_text(found.get('added') or [])}), added after it attached (a block appended "
            "to a ModuleList or Sequential, a new head, weight_norm or another parametrization "
            "registered with new tensors)"
            + (f", and no longer had {names_text(gone)}, which the bundle holds as the recorder "
               "last saw them" if gone else "")
            + ": the recorder neither hooked, checked nor bundled them, so this step cannot be "
            "re-run as it ran; call rec.detach() then rec.attach() right after changing the "
            "model, then the bundle holds the model that ran (and a factory that builds it "
            "replays it)")


HINT = ("the model that ran is not the one the recorder was attached to, so this step cannot be "
        "re-run: call rec.detach() then rec.attach() right after adding layers or "
        "parametrizations to the model, and record the run again")


def notes(fid: dict | None, step: Step) -> list[str]:
    """The note for a re-run the fidelity check did not put down to the added parameters
    (it matched up to the event, or had nothing to compare): they may still be what differs."""
    after = after_attach(step)
    return [text(after)] if after and not (fid and fid.get("added")) else []
