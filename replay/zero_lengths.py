"""Records of length 0, told by a count the batch gives one of per sample.

A padding collate_fn returns each record's length beside the padded batch
(``pad_sequence(seqs), torch.tensor([len(s) for s in seqs])``) and the model's masked mean
divides by it: a record with no step (an empty transcript, a clip cut to nothing) makes 0/0
there. The lengths hold one value per sample, so :mod:`replay.empty_records`' 0/1 data, which
needs several per sample, misses them and the hint stayed an eps on the divisor, which turns
the empty record into a zero vector the model trains on. Here such a count, 0 in exactly the
origin's samples and positive in every other one, names them as empty records, where it is
told from a label: a length bounds a padded dim of other data of the batch (the padded
batch ends in padding past each record's length, and not at its last kept step), while a
class label passed to a cross entropy does not (a class 0 is no empty record).
"""

from __future__ import annotations

from typing import Any

import torch


def zero_length_hint(report: dict[str, Any], tensors, rows: list[int], data=(),
                     lengths=()) -> bool:
    """Append the per-sample counts (``tensors``: (name, tensor, sample dim) of the batch) that
    are 0 in exactly ``rows`` and bound the padding of some of ``data`` (the batch's tensors
    of several values per sample), and the ``lengths`` (a nested batch's, lengths by
    construction) that are; whether any was."""
    data = list(data)
    names = [name for name, t, d in tensors if _zero_in(t, d, rows)
             and any(padded_by(t.reshape(-1), u, e) for _, u, e in data)]
    names += [name for name, t, d in lengths if _zero_in(t, d, rows)]
    if not names:
        return False
    which = ",".join(str(r) for r in rows)
    report["hint"] = (
        f"{report['hint']}. Sample(s) {which} are empty records: {' and '.join(names)} "
        f"(one count per sample: a length) {'is' if len(names) == 1 else 'are'} 0 in their "
        "rows and positive in every other sample's (a sequence of length 0: an empty "
        "transcript, a clip with no frame), so a mean over their steps divides 0 by 0 here; "
        "filter such records where the data is made (the dataset, the collate_fn) or floor "
        f"the count (lengths.clamp_min(1)) (--try drop={which} re-runs the step without them)")
    return True


def _zero_in(t: torch.Tensor, d: int, rows: list[int]) -> bool:
    """``t`` holds one whole number >= 0 per sample (along ``d``), 0 in each of ``rows`` and
    in no other."""
    if t.numel() != t.shape[d] or t.is_complex() or t.dtype == torch.bool \
            or max(rows) >= t.numel() or len(rows) >= t.numel():
        return False
    v = t.detach().reshape(-1)
    if bool((v < 0).any()) or (v.is_floating_point() and not bool((v == v.round()).all())):
        return False
    named = torch.zeros(v.numel(), dtype=torch.bool)
    named[rows] = True
    return bool((v[named] == 0).all()) and bool((v[~named] > 0).all())


def padded_by(v: torch.Tensor, t: torch.Tensor, d: int) -> bool:
    """``t`` (samples along ``d``) is padded to the counts ``v``: along some other dim, every
    sample's entries from its count on hold one value (the padding), and no sample's last
    entry before its count is all that value."""
    if t.shape[d] != v.numel() or t.dim() < 2 or t.is_complex():
        return False
    m, v = t.detach().movedim(d, 0), v.detach().long()
    for p in range(1, m.dim()):
        seq = m.movedim(p, 1)
        n = seq.shape[1]
        if int(v.max()) > n:
            continue
        beyond = torch.arange(n)[None, :] >= v[:, None]
        if not bool(beyond.any()):
            continue
        pads = seq[beyond]
        pad = pads.reshape(-1)[0]
        kept = v > 0
        last = seq[kept.nonzero().flatten(), v[kept] - 1]
        if bool((pads == pad).all()) and not bool(
                (last == pad).reshape(last.shape[0], -1).all(1).any()):
            return True
    return False
