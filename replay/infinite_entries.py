"""A batch tensor of records by features ``(B, F)`` holding +-Inf (no NaN) at a few entries of
some records, in a few of its features, finite everywhere else: a ratio the export computed
with a zero denominator (a flow's ``bytes / duration`` rate for a zero-duration flow, as
CIC-IDS2017's CSVs hold ``Infinity`` in ``Flow Bytes/s``; a per-second count, a percentage of a
total of 0). Not a broken record to filter nor missing values to impute (NaN: see
:mod:`replay.missing_entries`): the fix is that ratio, where the data is made.

Or +Inf and -Inf both, each feature holding at most one of each: the ends of a per-feature
transform that maps the feature's extremes onto the edges of an inverse CDF's domain (a
rank-gauss ``erfinv(2 * rank / (n - 1) - 1)`` of the smallest and largest value, a logit of a
min-max scaled feature): the fix is a clip inside the open interval before the transform.
"""

from __future__ import annotations

import torch

from .missing_entries import entries_where

__all__ = ["INFINITE_ENTRIES", "TRANSFORM_ENDS", "infinite_entries", "infinite_entries_hint",
           "one_sign_note", "transform_ends"]

INFINITE_ENTRIES = (
    "the batch itself holds Inf and no NaN, and {tensor} holds it at a few features of records "
    "otherwise finite: {where}: a ratio the data pipeline or the export computed with a "
    "denominator of 0 (a rate bytes / duration of a zero-duration flow: CIC-IDS2017's "
    "'Infinity' in Flow Bytes/s; a per-second count; a share of a total of 0); fix it where "
    "the data is made: floor the denominator (duration.clip(lower=eps)), or replace the "
    "infinities (df.replace([np.inf, -np.inf], np.nan)) and impute them (the feature's finite "
    "maximum over the training set, with a flag column) or drop those records, before any "
    "statistic of the column (a mean or std over it is then Inf or NaN too)")
# what else puts one sign of infinity at a feature's entries (added to INFINITE_ENTRIES)
ONE_SIGN = {
    "+inf": "; or a per-feature transform's upper end at a feature's largest value (a "
            "rank-gauss erfinv(2 * rank / (n - 1) - 1) at rank n - 1, a logit of a min-max "
            "scaled 1): keep the scaled values inside the open interval (ranks (rank + 0.5) "
            "/ n, x.clamp(-1 + eps, 1 - eps)) before the transform",
    "-inf": "; -Inf alone is as often a log of a 0 (np.log of a count or an amount that can "
            "be 0, where log1p was meant) or a per-feature transform's lower end at a "
            "feature's smallest value (a rank-gauss erfinv at rank 0, a logit of a min-max "
            "scaled 0): log1p, or keep the scaled values inside the open interval before the "
            "transform",
}

TRANSFORM_ENDS = (
    "the batch itself holds +Inf and -Inf and no NaN, and {tensor} holds them at most once per "
    "feature, each sign: {where}: a feature's smallest and largest values, which a "
    "per-feature transform sent to the ends of an inverse CDF's domain (a rank-gauss "
    "erfinv(2 * rank / (n - 1) - 1), whose ranks 0 and n - 1 are -1 and 1; a quantile "
    "transform to the normal; logit or atanh of a min-max scaled feature, 0 and 1 at its "
    "extremes); keep the scaled values inside the open interval before the transform "
    "(ranks (rank + 0.5) / n, x.clamp(-1 + eps, 1 - eps)), as sklearn's QuantileTransformer "
    "clips, fitted on the training fold and applied to the others")


def infinite_entries_hint(t: torch.Tensor | None, d: int | None, tensor: str) -> str | None:
    """The hint for batch tensor ``tensor`` (``t``, samples in dim ``d``) holding +-Inf at a
    few entries: a transform's ends (both signs), or a ratio's zero denominator; else None."""
    if where := transform_ends(t, d):
        return TRANSFORM_ENDS.format(tensor=tensor, where=where)
    if where := infinite_entries(t, d):
        return INFINITE_ENTRIES.format(tensor=tensor, where=where) + one_sign_note(t)
    return None


def transform_ends(t: torch.Tensor | None, d: int | None) -> str:
    """Where ``t``'s infinities lie, as text, when ``t`` is ``(B, F)`` with its samples in dim
    0, no NaN, +Inf and -Inf both, each feature holding at most one +Inf and one -Inf and each
    record infinite at fewer than half its features; else ""."""
    if t is None or d != 0 or t.dim() != 2 or t.shape[1] < 2 or not t.is_floating_point():
        return ""
    x = t.detach()
    pos, neg = x == float("inf"), x == float("-inf")
    if not bool(pos.any()) or not bool(neg.any()) or bool(torch.isnan(x).any()):
        return ""
    if bool((pos.sum(0) > 1).any()) or bool((neg.sum(0) > 1).any()):
        return ""
    inf = pos | neg
    if bool((2 * inf.sum(1) >= t.shape[1]).any()):
        return ""
    return entries_where(inf)


def infinite_entries(t: torch.Tensor | None, d: int | None) -> str:
    """Where ``t``'s infinities lie, as text, when ``t`` is ``(B, F)`` with its samples in dim
    0, every non-finite value +-Inf, in fewer than half of its features and of each record's
    features; else ""."""
    if t is None or d != 0 or t.dim() != 2 or t.shape[1] < 2 or not t.is_floating_point():
        return ""
    x = t.detach()
    inf = torch.isinf(x)
    if not bool(inf.any()) or bool(torch.isnan(x).any()):
        return ""
    cols = inf.any(0)
    if 2 * int(cols.sum()) >= t.shape[1]:
        return ""
    return entries_where(inf)


def one_sign_note(t: torch.Tensor | None) -> str:
    """:data:`ONE_SIGN`'s note for ``t``'s infinities when all are of one sign; else ""."""
    if t is None or not t.is_floating_point():
        return ""
    pos, neg = bool((t == float("inf")).any()), bool((t == float("-inf")).any())
    return ONE_SIGN["+inf"] if pos and not neg else ONE_SIGN["-inf"] if neg and not pos else ""
