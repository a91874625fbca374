"""Records with nothing in them, where a division made 0/0 on their samples.

A mean over each record's valid entries, ``(x * mask).sum(1) / mask.sum(1)``, a window or
attention normalised by its sum over the record's kept positions (``phi * char_mask``, then
``phi / phi.sum()``), divide by a count or a mass that is 0 when the record is empty: a
stroke file left empty by filtering, a transcription none of whose characters is in the
alphabet. The op's advice (an eps) is one fix; the hint adds which data the named samples
lack, a 0/1 tensor of the batch (a mask, a one-hot sequence) with no entry set in their rows
while every other sample has one (not a right-padded batch's padding mask, True at the
padding: its rows with none set are the longest records), or token ids holding in their rows nothing but the ids every
sample holds (``<cls>``, ``<eos>``) and their padding, so the user can filter such records
where they are made (labels ignored at every position of those rows:
:mod:`replay.ignored_rows`). Where real-valued data of the batch is 0 everywhere in just those rows
too (an MRI volume's padding slice: its k-space, its target and its body outline all 0), the
hint names it beside the mask: the divided 0 may be that data's max or norm (k-space
normalised by its max, SSIM's ``C1``/``C2`` from the target's range), not a count.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import batch_path, loss_path
from recorder.finite import zero_one

from .ignored_rows import ignored_rows_hint
from .load import Step
from .nested_lengths import nested_lengths
from .recorded import n_args, samples
from .zero_lengths import zero_length_hint

_DIVIDING = {"aten.div", "aten.div_", "aten.reciprocal"}


def empty_records_hint(report: dict[str, Any], step: Step) -> None:
    """Append the 0/1 tensors empty in exactly the samples of an ``invalid`` 0/0 division."""
    o = report["origin"]
    rows, mb = o.get("samples") or [], o.get("micro_batch") or 0
    if report.get("cause") != "invalid" or o.get("op") not in _DIVIDING or not rows \
            or o.get("all_samples") or "0 by 0" not in (report.get("hint") or ""):
        return
    # (a forward op took no loss data: where a model input is 0 everywhere in just these
    # rows, a silent clip, the loss's 0s there are that blank record's labels, no species
    # set, not a mask that emptied it; a fragment's frame mask still says why)
    loss = o.get("phase") != "forward" or not any(
        zero_rows(t, d, rows) for _, t, d in batch_data(step, mb, loss=False))
    data = list(batch_data(step, mb, loss=loss))
    # (data the forward never took, the loss's alone, explains a forward 0/0 as a mask of
    # valid positions: one run each row, or over positions of a model input, a residue pair
    # mask; a multi-label target with no class set is a label)
    seen = {name: _sizes(t, d) for name, t, d in batch_data(step, mb, loss=False)} \
        if o.get("phase") == "forward" else None
    names = [name for name, t, d in data if _empty_in(t, d, rows) and (
        seen is None or name in seen or _one_run(t, d)
        or any(_sizes(t, d) & sizes for sizes in seen.values()))]
    if names:
        which = ",".join(str(r) for r in rows)
        # (a loss that weights them 0 by design, DM-Count's TV term times an empty crop's
        # count: they are data it trains on, not records to filter)
        fix = "floor the count (count.clamp_min(1)): the loss weights them 0 by design, so " \
            "they are no bad records" if "nothing is to drop" in report["hint"] else \
            "filter such records where the data is made (the dataset, the collate_fn) or " \
            "floor the count (count.clamp_min(1))"
        report["hint"] = _empty_text(report["hint"], which, names, fix, [
            name for name, t, d in data if not zero_one(t) and zero_rows(t, d, rows)])
        return
    # (a graph batch's count of nodes per graph: replay.empty_graphs names its empty graphs)
    if _length_zero(report, data, rows) or samples(step, mb).segments is None \
            and zero_length_hint(report, sample_tensors(step, mb, loss), rows, data,
                                 nested_lengths(step, mb)):
        return
    names = [name for name, t, d in data if _empty_in(t, d, rows, least=2)]
    if names:  # (a sequence of one step: its next-step targets, mask[:, 1:], are none)
        which = ",".join(str(r) for r in rows)
        report["hint"] = (
            f"{report['hint']}. Sample(s) {which} are records of a single step: "
            f"{' and '.join(names)} (0/1 data) {'has' if len(names) == 1 else 'have'} one "
            "entry set in their rows and two or more in every other sample's (a student "
            "with one interaction, a track of one point), so a count over the steps that "
            "have a next one (a next-step target's mask[:, 1:], consecutive pairs), or the "
            "count less one (an unbiased variance's n - 1: per-utterance mean and variance "
            "normalisation), is the 0 divided here; filter records shorter than 2 steps "
            "where the data is made (the "
            "dataset, the collate_fn) or floor the count (count.clamp_min(1)) "
            f"(--try drop={which} re-runs the step without them)")
        return
    if not ignored_rows_hint(report, data, rows):
        _special_hint(report, data, rows)


def _special_hint(report: dict[str, Any], data: list, rows: list[int]) -> None:
    """Append the token ids holding in exactly ``rows`` nothing but special tokens."""
    names = [name for name, t, d in data if _special_only(t, d, rows)]
    if names:  # (token ids: a crop or a cleaning left <cls> <eos> and padding)
        which = ",".join(str(r) for r in rows)
        report["hint"] = (
            f"{report['hint']}. Sample(s) {which} are empty records: {' and '.join(names)} "
            f"(token ids) {'holds' if len(names) == 1 else 'hold'} in their rows only ids "
            "every sample holds (special tokens: "
            "<cls>, <eos>) and the padding their rows end with, while every other sample "
            "holds more (a sequence cropped to nothing, a text with no token left), so a "
            "count of their real tokens is the 0 divided here; filter such records where the "
            "data is made (the dataset, the crop, the collate_fn) or floor the count "
            f"(count.clamp_min(1)) (--try drop={which} re-runs the step without them)")


def _empty_text(hint: str, which: str, names: list[str], fix: str, blank: list[str]) -> str:
    """The empty-records sentence; ``blank``: real-valued data 0 everywhere in just those rows
    too (a padding slice: its k-space and its target all 0), whose max, norm or sum may be
    the 0 divided as much as a count over the mask."""
    also = f" (or, as {' and '.join(blank)} {'is' if len(blank) == 1 else 'are'} 0 " \
        "everywhere in their rows too, a max, a norm or a sum of that data: a padding " \
        "slice or frame)" if blank else ""
    return (
        f"{hint}. Sample(s) {which} are empty records: {' and '.join(names)} "
        f"(0/1 data) {'has' if len(names) == 1 else 'have'} no entry set in their rows "
        "and one in every other sample's (a "
        "mask with no valid position, a sequence of length 0, a transcription with no "
        f"character), so a count or a sum over them{also} is the 0 divided here; {fix} "
        f"(--try drop={which} re-runs the step without them)")


def _length_zero(report: dict[str, Any], data: list, rows: list[int]) -> bool:
    """Append the padding masks set at every position of exactly ``rows`` (an utterance with
    no audio frame: its ``key_padding_mask`` row all True); whether any was."""
    names = [name for name, t, d in data if _padding_mask(t, d, rows, whole=True)]
    if not names:
        return False
    which = ",".join(str(r) for r in rows)
    report["hint"] = (
        f"{report['hint']}. Sample(s) {which} are empty records: {' and '.join(names)} "
        f"(a padding mask, True at the padding) {'is' if len(names) == 1 else 'are'} set "
        "at every position of their rows, and in every other sample's only at its padded "
        "end (a sequence of length 0: an utterance with no frame, a text with no token), so "
        "a count or a sum over their kept positions is the 0 divided here; filter such "
        "records where the data is made (the dataset, the collate_fn) or floor the count "
        f"(count.clamp_min(1)) (--try drop={which} re-runs the step without them)")
    return True


def batch_data(step: Step, mb: int, loss: bool = True):
    """(readable name, tensor, sample dim) of the micro-batch's real-valued model inputs, then
    (``loss``) its loss arguments that are data (not made of the model output), with more
    than one value per sample."""
    # (a bool or integer mask too: to_dense_batch's, a tokenizer's attention_mask)
    return ((name, t, d) for name, t, d in sample_tensors(step, mb, loss)
            if not t.is_complex() and t.numel() > t.shape[d])


def sample_tensors(step: Step, mb: int, loss: bool = True):
    """(readable name, tensor, sample dim) of the micro-batch's model inputs, then (``loss``)
    its loss arguments that are data, that have a dim of the samples."""
    if mb >= len(step.micro_batches):
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    count, made = n_args(entry.get("inputs")), set(entry.get("loss_grad_args") or ())
    named = [(k, batch_path(raw, count)) for k, raw in (entry.get("paths") or {}).items()]
    named += [(k, loss_path(raw)) for k, raw in (entry.get("loss_paths") or {}).items()
              if loss and k not in made]
    for key, name in named:
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and t.numel() and (d := where.dim(t)) is not None:
            yield name, t, d


def _empty_in(t: torch.Tensor, d: int, rows: list[int], least: int = 1) -> bool:
    """``t`` holds only 0s and 1s, fewer than ``least`` set in each of ``rows``, at least
    ``least`` in every other row."""
    if max(rows) >= t.shape[d] or len(rows) >= t.shape[d] \
            or not zero_one(t) or _padding_mask(t, d, rows):
        return False
    kept = t.detach().movedim(d, 0).reshape(t.shape[d], -1).ne(0).sum(1) >= least
    named = torch.zeros_like(kept)
    named[rows] = True
    return not bool(kept[named].any()) and bool(kept[~named].all())


def _padding_mask(t: torch.Tensor, d: int, rows: list[int], whole: bool = False) -> bool:
    """``t`` (samples along ``d``, then positions) is a right-padded batch's padding mask,
    True at the padding (``key_padding_mask``, ``pad_sequence``'s lengths compared with
    ``arange``): every other row's set entries are one run ending at the last position, and
    no other row is set everywhere (a keep mask sets its longest record's every position).
    Its rows with nothing set are the longest records, not empty ones; ``whole``: ``rows``
    are set everywhere, records of length 0 (while some other row has padding)."""
    if t.dim() != 2 or max(rows) >= t.shape[d] or len(rows) >= t.shape[d] \
            or not zero_one(t):
        return False
    m = t.detach().movedim(d, 0).ne(0)
    named = torch.zeros(m.shape[0], dtype=torch.bool)
    named[rows] = True
    full = m.all(1)
    if bool(full[~named].any()) or (whole and not bool(full[named].all())):
        return False
    counts = m.sum(1)
    for r in (~named).nonzero().flatten().tolist():
        n = int(counts[r])
        if not bool(m[r, m.shape[1] - n:].all()) or n == 0 and not whole:
            return False
    return not whole or bool(counts[~named].any())


def _sizes(t: torch.Tensor, d: int) -> set[int]:
    """The sizes > 1 of ``t``'s dims other than the samples' ``d``."""
    return {n for i, n in enumerate(t.shape) if i != d and n > 1}


def _one_run(t: torch.Tensor, d: int) -> bool:
    """``t`` (samples along ``d``) is set, along some other dim, in one run touching its
    start or its end in each sample (a keep mask of valid frames or steps)."""
    m = t.detach().movedim(d, 0).ne(0)
    for p in range(1, m.dim()):
        s = m.movedim(p, 1).reshape(m.shape[0], m.shape[p], -1).any(2)
        n = s.sum(1)
        edges = (s[:, 1:] != s[:, :-1]).sum(1)
        if m.shape[p] > 1 and bool((edges <= 1).all()) and bool((n < m.shape[p]).any()):
            return True
    return False


def zero_rows(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` is 0 everywhere in each of ``rows`` (its samples along ``d``) and no other row is
    all 0."""
    if max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return False
    blank = t.detach().movedim(d, 0).reshape(t.shape[d], -1).eq(0).all(1)
    named = torch.zeros_like(blank)
    named[rows] = True
    return bool(blank[named].all()) and not bool(blank[~named].any())


def _special_only(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` holds integer ids, and each of ``rows``, once the run of one id it ends with
    (its padding) is left out, holds only ids that every other row holds, while every other
    row holds an id outside those and its padding."""
    if t.is_floating_point() or t.dtype == torch.bool or t.dim() != 2 \
            or max(rows) >= t.shape[d] or len(rows) >= t.shape[d]:
        return False
    ids = t.detach().movedim(d, 0).tolist()
    others = [row for r, row in enumerate(ids) if r not in rows]
    shared = set.intersection(*(set(row) for row in others))
    for r in rows:
        row, pad = list(ids[r]), ids[r][-1]
        while row and row[-1] == pad:
            row.pop()
        if not set(row) <= shared or any(set(o) <= set(row) | {pad} for o in others):
            return False
    return True
