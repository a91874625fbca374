"""A loss's 0/0 over a whole batch whose per-sample weights (or mask) are 0 in every sample.

A weighted mean, ``(per * weight).sum() / weight.sum()``, divides by the batch's total weight:
0 when the loader yielded a batch of records all weighted 0 (a last short batch of excluded
records, a bucket of unlabelled ones, a sampler's draw of masked samples). The op's advice (a
0-d divisor, no row to blame) says what to change in the formula; the hint adds which tensor of
the batch is 0 throughout it, so the user knows it is this batch's data, not the code, and
where it was made. Named only where the loss's statement reads that tensor (its parameter's
name, or the batch key, is a word of the line the op ran on), and only for a tensor of a row
per sample, real-valued (a weight or a float mask: an all-0 integer input is
``replay.padding_batch``'s padding)."""

from __future__ import annotations

import re
from typing import Any

from .empty_records import sample_tensors
from .load import Step
from .loss_arg_name import with_param_name
from .source import statement

_LAST = re.compile(r'(?:\["([^"]+)"\]|\.(\w+)|\((\w+)\))$')


def zero_weights_hint(report: dict[str, Any], step: Step) -> None:
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    n = o.get("batch_size") or 0
    if report.get("cause") != "invalid" or o.get("phase") != "loss" or o.get("samples") \
            or "0 by 0" not in hint or "no row is to blame" not in hint or not n:
        return
    code = _code(o.get("source") or "")
    if not code:
        return
    mb = o.get("micro_batch") or 0
    names = []
    for name in _data(step, mb, n):
        named = with_param_name(name, step.loss_fn)
        m = _LAST.search(named)
        word = next((g for g in m.groups() if g), None) if m else None
        if word and re.search(rf"\b{re.escape(word)}\b", code):
            names.append(named)
    if names:
        report["hint"] = (
            f"{hint}. Here {' and '.join(names)}, which the loss's line reads, "
            f"{'is' if len(names) == 1 else 'are'} 0 in every one of the batch's {n} "
            "samples: the loader yielded a batch with no weighted (or unmasked) sample (a "
            "last short batch of records all weighted 0, a bucket or a sampler's draw of "
            "excluded ones); skip such batches (if w.sum() == 0: continue) or divide by "
            "w.sum().clamp_min(1e-8), and check the records where those weights are made")


def _data(step: Step, mb: int, n: int):
    """The readable names of the micro-batch's real-valued model inputs and loss data
    arguments with a row per sample (a ``(B,)`` weight too) that are 0 everywhere."""
    for name, t, d in sample_tensors(step, mb):
        if t.is_floating_point() and t.shape[d] == n and not bool(t.detach().ne(0).any()):
            yield name


def _code(source: str) -> str:
    path, _, line = source.rpartition(":")
    return statement(path, int(line)) if path and line.isdigit() else ""
