"""Samples whose recorded data is negative where every other sample's is not: a time since
dose of -150 h (records sorted by clock time across a day change, a dose logged after its
sample), a negative count or amount, a sign flipped in one record. Such a value need not stand
10x above the other rows (:mod:`replay.outliers`: a week's 168 h dwarfs it), yet it sends
``exp(-k t)`` past float32's range or a log or sqrt out of its domain; a clamp or a wider type
would hide the corrupt record as a finite, wrong value. The hint names the record instead.

An op that pools the batch (a statistic over its rows: a SNP's allele frequency
``p = g.mean(0) / 2`` under ``sqrt(2p(1-p))``) names every row; there the few rows (under half
the batch) negative where every other is 0 or more are named: a genotype call coded PLINK's
``-9`` for missing pulls one SNP's frequency below 0."""

from __future__ import annotations

from typing import Any

import torch

from .cause_text import DO
from .data_pole import AS_GIVEN, nines_code
from .domains import g
from .drop import undroppable
from .load import Step
from .outliers import row_values


def negative_input(step: Step, mb: int, rows: list[int]) -> dict[str, Any] | None:
    """The first floating tensor of micro-batch ``mb`` (model inputs, then loss arguments)
    negative in each of ``rows`` and nowhere in every other row, which holds positive values
    (data of one sign: its rows are no standardised feature): ``{"tensor": its readable name,
    "value": the rows' most negative value}``; None when there is none."""
    for _key, name, _missing, a in row_values(step, mb):
        if not rows or max(rows) >= len(a) or len(rows) >= len(a):
            continue
        named = torch.zeros(len(a), dtype=torch.bool)
        named[rows] = True
        low = torch.nan_to_num(a, nan=0.0).amin(1)
        others = a[~named]
        if bool((low[named] < 0).all()) and bool((others >= 0).all()) \
                and bool((others > 0).any()):
            mine = a[named]
            return {"tensor": name, "value": float(low[named].min()),
                    "code": nines_code(mine[mine < 0])}
    return None


def pooled_negative_rows(step: Step, mb: int) -> tuple[list[int], dict[str, Any]] | None:
    """(rows, as :func:`negative_input`) of the first floating tensor of micro-batch ``mb``
    negative in a few rows alone (fewer than half the batch's), 0 or more in every other row,
    which holds positive values; None when there is none."""
    for _key, name, _missing, a in row_values(step, mb):
        low = torch.nan_to_num(a, nan=0.0).amin(1)
        named = low < 0
        rows = named.nonzero().flatten().tolist()
        if not rows or 2 * len(rows) >= len(a):
            continue
        others = a[~named]
        if bool((others >= 0).all()) and bool((others > 0).any()):
            mine = a[named]
            return rows, {"tensor": name, "value": float(low[named].min()),
                          "code": nines_code(mine[mine < 0])}
    return None


# (the advice of an op out of its domain or at its pole: log, sqrt, pow of a negative)
_EDGE_ADVICE = tuple(DO[k] for k in ("domain", "log_domain", "log1p_pole", "power_domain",
                                     "pole"))


def negative_hint(report: dict[str, Any], step: Step) -> bool:
    """Append to an overflow's or a domain error's hint, where no out-of-scale record was
    named, the samples whose data alone is negative (:func:`negative_input`); True when
    said."""
    o, hint = report["origin"], report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    edge = report.get("cause") == "invalid" and any(a in hint for a in _EDGE_ADVICE)
    # (not where an out-of-scale record or a value the op took as given was named)
    if not rows or "out of scale" in hint or AS_GIVEN in hint \
            or not (report.get("cause") == "overflow" or edge):
        return False
    pooled = ""
    if o.get("all_samples"):  # (a statistic over the batch: the few rows that stand apart)
        found_rows = pooled_negative_rows(step, mb) if edge else None
        if found_rows is None:
            return False
        (rows, found), pooled = found_rows, (
            " The op's input pools every sample of the batch (a statistic over its rows), so "
            "each row is named; s")
    else:
        found = negative_input(step, mb, rows)
    if found is None:
        return False
    which = ",".join(str(r) for r in rows)
    how = (f" (--try drop={which} re-runs the step without them)"
           if undroppable(step, mb) is None else "")
    if found.get("code") is not None:
        report["hint"] = (
            f"{hint}.{pooled or ' But s'}ample(s) {which} of {found['tensor']} hold "
            f"{g(found['code'])} where every other sample's values are 0 or more: a "
            "missing-value code (a band or feature not measured, PLINK's -9 for a missing "
            "genotype call), which the model took as a value; mask those entries or impute "
            f"them (with a missing-indicator) where the data is made, before the model{how}")
        return True
    report["hint"] = (
        f"{hint}.{pooled or ' But s'}ample(s) {which} of {found['tensor']} hold negative values (down to "
        f"{g(found['value'])}) where every other sample's are 0 or more: the data of these "
        "samples is out of its range (a time since an event taken before the event, records "
        "sorted the wrong way, a flipped sign), which a clamp or a wider type would only hide "
        f"as a wrong value; fix or filter them{how}")
    return True
