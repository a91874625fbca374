"""An op run outside its domain (log1p below -1, log or sqrt of a negative) or at its pole on a
few samples whose recorded data is out of scale with the rest of the batch: a timestamp in
milliseconds among seconds makes the gap after it hugely negative, and ``log1p(gap)`` NaN; a
raw population among standardised features overflows NB2's ``alpha = exp(...)``, and
``lgamma(1 / alpha)`` is at its pole 0; a gaze label stored as a target point in millimetres,
never normalised, makes ``asin(-g[:, 1])`` of a number in the hundreds (not a cosine rounded
past 1: only an input past +-1 by more than rounding counts there). The op's advice
(clamp its input into the domain) would hide the corrupt record as a finite, wrong feature;
the hint names the record, as an overflow's does (:mod:`replay.data_scale`)."""

from __future__ import annotations

from typing import Any

from .cause_text import DO
from .domains import g
from .drop import undroppable
from .load import Step
from .outliers import outlier_input

_DOMAIN_ADVICE = (DO["domain"], DO["log_domain"], DO["log1p_pole"], DO["power_domain"])
_POLE_ADVICE = (DO["pole"],)  # (a pole: "out of its domain" would misname it)
ROUNDING = 1.1  # |x| beyond this is no unit cosine rounded past 1 (bfloat16's ulp is 0.008)


def _unit_far_out(report: dict[str, Any]) -> bool:
    """An acos/asin origin whose input reached past +-1 by more than any rounding."""
    chain = report["origin"].get("chain") or [{}]
    top = max(abs(chain[0].get("input_min") or 0.0), abs(chain[0].get("input_max") or 0.0))
    return top > ROUNDING


def domain_outlier_hint(report: dict[str, Any], step: Step) -> None:
    """Append the out-of-scale data of an ``invalid`` domain origin's own samples."""
    o, hint = report["origin"], report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or not rows or o.get("all_samples") \
            or not (any(advice in hint for advice in _DOMAIN_ADVICE + _POLE_ADVICE)
                    or (DO["unit"] in hint and _unit_far_out(report))):
        return
    found = outlier_input(step, mb, rows)
    if found is None:
        return
    which = ",".join(str(r) for r in rows)
    ratio = (f", {g(found['value'] / found['others'])}x the other rows' largest "
             f"{g(found['others'])}" if found["others"] > 0 else ", the other rows being 0")
    how = (f" (--try drop={which} re-runs the step without them)"
           if undroppable(step, mb) is None else "")
    edge = ("to its pole" if any(advice in hint for advice in _POLE_ADVICE)
            else "out of its domain")
    report["hint"] = (
        f"{hint}. But sample(s) {which} of {found['tensor']} reach {g(found['value'])}{ratio}: "
        "the data of these samples is out of scale (a wrong unit, as a timestamp in "
        f"milliseconds among seconds; a corrupt record), which drove the op {edge} "
        f"and which a clamp would only hide as a wrong value; fix or filter them{how}")
