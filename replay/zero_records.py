"""Samples whose model input is all 0, where an op hit its pole or left its domain on those
samples alone.

A metric depth head scaled by each camera's focal length (``depth * focal / f0``, the focal
an extra ``forward`` argument) outputs 0 for an image whose intrinsics were never filled
(focal 0), and the loss's ``log(pred)`` is -inf on that image; a blank frame (0 after
normalisation) does the same through a bias-free tower. The op's advice (clamp its input, an
eps) would train on a record holding nothing; the hint names the input and the samples, so
the user fixes or filters the record where the data is made. Non-negative data of several
entries a sample (counts) is :mod:`replay.empty_counts`', 0/1 masks
:mod:`replay.empty_records`'; a hint that names the data already gains nothing here."""

from __future__ import annotations

from typing import Any

import torch

from .drop import undroppable
from .empty_counts import root_inputs
from .load import Step

_SAID = ("Sample(s) ", "sample(s) ", "nothing is to drop")  # (the data is named already)


def zero_records_hint(report: dict[str, Any], step: Step) -> None:
    """Append the model input all 0 in exactly the samples of an ``invalid`` origin."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or not rows or o.get("all_samples") or not hint \
            or any(said in hint for said in _SAID):
        return
    name = next((name for name, t, d in root_inputs(step, mb, scalars=True)
                 if _zero_in(t, d, rows)), None)
    if name is None:
        return
    which = ",".join(str(r) for r in rows)
    how = (f" (--try drop={which} re-runs the step without them)"
           if undroppable(step, mb) is None else "")
    report["hint"] = (
        f"{hint}. But {name} is 0 everywhere in sample(s) {which} and not in any other "
        "sample: a blank record (a camera intrinsic never filled, an empty frame) drove the op "
        "there, which an eps would only hide as a wrong value; fix or filter such records "
        f"where the data is made{how}")


def _zero_in(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` is not 0/1 data, all 0 in ``rows``, nonzero somewhere in every other row."""
    if max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return False
    x = t.detach().movedim(d, 0).reshape(t.shape[d], -1)
    if bool(((x == 0) | (x == 1)).all()):
        return False
    some = x.ne(0).any(1)
    named = torch.zeros_like(some)
    named[rows] = True
    return not bool(some[named].any()) and bool(some[~named].all())
