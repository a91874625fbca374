"""The origin's number attributes that made a division by the Python number 0.

A loss or module that min-max normalises with a range it holds as plain numbers (``(log(card)
- self.lo) / (self.hi - self.lo)``, fitted on the training labels) divides by 0 when the
range was fitted on values all equal: a training set of one query template, whose
log-cardinalities are one value, or a feature that never moved. The divisor's hint speaks of a
setting in general (a drop probability of 1, a temperature annealed to 0); the bundle holds the
origin's number attributes as the step closed, so the hint names those its source line reads
that are 0, or equal to each other (their difference is the 0), and where they come from:
set by the loop, or built so (a module's attributes at attach, which the loop never changed:
an exponential time surface's ``exp(-(t_ref - t) / self.tau)`` with ``tau = 0``). An
attribute the function first copied to a local (``T = self.temperature``, then
``student / T``: a distillation loss with a swept temperature of 0) is read as that local.
"""

from __future__ import annotations

import linecache
import re
from itertools import combinations
from typing import Any

from .cause_text import DO
from .domains import g
from .grown_number import number_attributes, when_read
from .load import Step


def zero_number_hint(report: dict[str, Any], step: Step) -> None:
    """Append the origin's number attributes that made its divisor 0 to such a hint."""
    o = report.get("origin") or {}
    if report.get("cause") != "invalid":
        return
    if DO["divide_number"] not in (report.get("hint") or ""):
        _pole_at_zero_number(report, step, o)
        return
    line = (report.get("source_lines") or {}).get(o.get("source") or "") or ""
    # (an attribute the function copied to a local first, ``T = self.temperature``, then
    # divided by as ``x / T``: read under that local's name)
    local = {a: n for n, a in _aliases(o.get("source") or "").items()
             if re.search(rf"\b{re.escape(n)}\b", line)}
    read = {k: v for k, v in number_attributes(step, o.get("module"), built=True).items()
            if type(v) in (int, float) and (re.search(rf"\b{re.escape(k)}\b", line)
                                            or k in local)}
    owner = "the loss" if o.get("module") == "<loss>" else o.get("module") or "the model"
    equal = [(a, b) for a, b in combinations(read, 2)
             if read[a] == read[b] and (_minus(line, b, a) or _minus(line, a, b))]
    zero = [k for k, v in read.items() if v == 0]
    read_as = f" (read as {local[zero[0]]})" if zero and zero[0] in local else ""
    if equal:
        a, b = equal[0] if _minus(line, *reversed(equal[0])) else reversed(equal[0])
        report["hint"] = (
            f"{report['hint']}. Here {owner}'s attributes {a} and {b} are both "
            f"{g(read[a])} {when_read(step, o.get('module'), a)}, and the line divides by their difference: a "
            "range fitted where the minimum equals the maximum (min-max normalisation of labels "
            "that are all one value, as a training set of a single query template; a feature "
            "that never moved), so every value divides by 0. Fit the range on data that "
            f"varies, or divide by max({b} - {a}, eps) and map a constant range to 0")
    elif zero and zero[0] in number_attributes(step, o.get("module")):
        report["hint"] = (f"{report['hint']}. Here {owner}'s attribute {zero[0]}{read_as} is 0 "
                          f"{when_read(step, o.get('module'), zero[0])}, and the line divides by "
                          "it: that is the setting to find where it was computed")
    elif zero:
        report["hint"] = (
            f"{report['hint']}. Here {owner}'s attribute {zero[0]}{read_as} is 0, as it was when "
            "the recorder attached (the loop never changed it), and the line divides by it: the "
            "model was built with it 0 (a constructor argument or config value, a time "
            "constant or temperature of 0 meant as 'off'); build it positive, or check it is "
            "> 0 where the module takes it")


def _pole_at_zero_number(report: dict[str, Any], step: Step, o: dict[str, Any]) -> None:
    """A pole op (``lgamma(L)``, ``log(L)``) given only 0s where the origin's owner holds a
    number attribute of 0 (a number of looks, a shape parameter set to 0): the op's input is
    a constant, no record's value, so the clamp or eps the hint offers would hide a setting
    that is out of its domain; name the attributes that are 0."""
    head = (o.get("chain") or [{}])[0]
    if o.get("made") not in ("+inf", "-inf") or head.get("input_min") != 0.0 \
            or head.get("input_max") != 0.0:
        return
    zero = [k for k, v in number_attributes(step, o.get("module")).items()
            if type(v) in (int, float) and v == 0 and not re.search(r"eps|offset", k)]
    if not zero:
        return
    owner = "the loss" if o.get("module") == "<loss>" else o.get("module") or "the model"
    report["hint"] = (
        f"{report['hint']}. Every value {o.get('op')} was given is 0, and {owner}'s attribute"
        f"{'s' if len(zero) > 1 else ''} {', '.join(zero)} "
        f"{'are' if len(zero) > 1 else 'is'} 0 as the step closed: if the op's input is made "
        "of it (lgamma(L) and log(L) of a number of looks or a shape parameter), the setting "
        "is outside the formula's domain, not a value to clamp: find where it was computed "
        "(an estimate rounded to 0, a config default of 0) and keep it positive")


def _minus(line: str, x: str, y: str) -> bool:
    """Whether ``line`` subtracts the attribute ``y`` from ``x`` (``self.hi - self.lo``)."""
    return re.search(rf"\b{re.escape(x)}\s*-\s*(?:\w+\.)?{re.escape(y)}\b", line) is not None


_DEF = re.compile(r"^\s*(async\s+)?def\s")
_ALIAS = re.compile(r"^\s*(\w+)\s*=\s*self\.(\w+)\s*(#.*)?$")
_ASSIGNED = re.compile(r"^\s*(\w+)\s*(?:[-+*/]?=(?!=)|:[^=]*=(?!=))")


def _aliases(source: str) -> dict[str, str]:
    """``{local: attribute}`` of the plain copies ``local = self.attribute`` that the function
    holding ``source`` (``file:line``) makes on its lines before that one (and does not
    assign again before it)."""
    path, _, line = source.rpartition(":")
    if not path or not line.isdigit():
        return {}
    lines = linecache.getlines(path)[:int(line) - 1]
    start = next((i for i in range(len(lines) - 1, -1, -1) if _DEF.match(lines[i])), None)
    if start is None:
        return {}
    found: dict[str, str] = {}
    for text in lines[start + 1:]:
        if (m := _ALIAS.match(text)) is not None:
            found[m.group(1)] = m.group(2)
        elif (m := _ASSIGNED.match(text)) is not None:
            found.pop(m.group(1), None)
    return found
