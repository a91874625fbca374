"""The origin's number attribute of 0 that its code adds as the eps that guarded nothing.

A loss or module built with its smoothing or eps set to 0 (MONAI's ``GeneralizedDiceLoss(...,
smooth_nr=0.0, smooth_dr=0.0)``, meant as "exact Dice"), whose ``denom = ... + self.smooth_dr``
then divides an empty class's 0 by 0: the hint already says the eps added to the divisor is
exactly 0 (``replay.lost_eps``), but not which setting it is. The bundle holds the origin's
number attributes; the ones that are 0 and that the code of the origin's function adds
(``+ self.name``, on its lines up to the op's) are named, so the user knows the option to set.
"""

from __future__ import annotations

import linecache
import re
from typing import Any

from .grown_number import number_attributes
from .load import Step

_SAID = "is exactly 0 (an eps option set to 0"
_DEF = re.compile(r"^(\s*)(async\s+)?def\s")


def zero_eps_attribute_hint(report: dict[str, Any], step: Step) -> None:
    """Name the origin's attributes of 0 its function adds, where the hint says an eps added
    was exactly 0."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    if _SAID not in hint or not o.get("source"):
        return
    zero = [k for k, v in number_attributes(step, o.get("module"), built=True).items()
            if type(v) is float and v == 0.0]
    added = _added_attributes(o["source"])
    named = [k for k in zero if k in added]
    if not named:
        return
    owner = "the loss" if o.get("module") == "<loss>" else o.get("module") or "the model"
    many = len(named) > 1
    report["hint"] = (
        f"{hint}. Here {owner}'s {'attributes' if many else 'attribute'} "
        f"{' and '.join(named)}, which its code adds ("
        f"{', '.join(f'+ self.{k}' for k in named)}), {'are' if many else 'is'} 0.0: that "
        f"eps of 0 is {'one of them' if many else 'it'}; build {owner} with "
        f"{' and '.join(f'{k} > 0' for k in named)}")


def _added_attributes(source: str) -> set[str]:
    """The ``self.name`` attributes that the function holding ``source`` (``file:line``) adds
    as a term of its own (``+ self.name`` or ``self.name +``, no factor: ``+ self.w * x``) on
    its lines up to that one."""
    path, _, line = source.rpartition(":")
    if not path or not line.isdigit():
        return set()
    lines = linecache.getlines(path)[:int(line)]
    start = next((i for i in range(len(lines) - 1, -1, -1) if _DEF.match(lines[i])), None)
    if start is None:
        return set()
    body = "".join(lines[start:])
    return set(_ADDED_AFTER.findall(body)) | set(_ADDED_BEFORE.findall(body))


# a term of its own (not a factor: ``+ self.weight * x``, nor a call or attribute of it)
_ADDED_AFTER = re.compile(r"\+\s*self\.(\w+)\b(?!\s*[*/@(.\[])")
_ADDED_BEFORE = re.compile(r"(?:^|[(=,+\[]|\breturn)\s*self\.(\w+)\s*\+(?!=)", re.M)
