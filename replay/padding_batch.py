"""A micro-batch that is padding throughout, whose loss averaged over no target.

Sequences padded to a fixed length (a config's ``max_seq_len``) and cut into segments
(Transformer-XL's memory carried between them): a batch whose sequences are all shorter than
that length (a bucket of short pieces, batches sorted by length) has its last segments padding
in every sample. The loss's masked mean then selects nothing, ``nll[mask].mean()`` or
``F.cross_entropy(..., ignore_index=pad)`` with every target ignored: 0/0. The op's advice (an
empty selection, a batch of 1) names no data; the hint adds the integer model inputs (token
ids) 0 everywhere in the micro-batch, and the loss's data 0 there too, so the user skips such
micro-batches or pads each batch to its own longest sequence. An all-0 integer model input,
not only an all-0 label (a batch with no positive of a class is no padding). So too for a
model that computes its loss in its own forward (x-transformers' ``AutoregressiveWrapper``
told ``ignore_index``, whose ``loss.sum() / valid.sum()`` is 0/0 there; a Hugging Face model
given labels): a forward origin in the root module.
"""

from __future__ import annotations

from typing import Any

import torch

from .empty_records import batch_data
from .load import Step

_EMPTY = ("of an empty tensor", "of 0 by 0 (0/0)")  # (replay.domains, replay.cause_text)


def padding_batch_hint(report: dict[str, Any], step: Step) -> None:
    """Append the micro-batch's data that is 0 everywhere, where an ``invalid`` empty
    reduction or 0/0 of the loss named no sample and an integer model input is all 0."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    # (or the model's own: a root forward's, x-transformers' AutoregressiveWrapper and Hugging
    # Face models given labels return their loss)
    own = o.get("phase") == "forward" and o.get("module") == ""
    if report.get("cause") != "invalid" or o.get("phase") not in ("loss", "backward") and not own \
            or o.get("samples") or not any(e in hint for e in _EMPTY):
        return
    mb = o.get("micro_batch") or 0
    blank = [(name, t) for name, t, _ in batch_data(step, mb)
             if t.dtype != torch.bool and not bool(t.detach().ne(0).any())]
    ids = [name for name, t in blank
           if not t.is_floating_point() and not name.startswith("loss_")]
    if not ids:
        return
    names = [name for name, _ in blank]
    names = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    report["hint"] = (
        f"{hint}. Here {names} {'is' if len(blank) == 1 else 'are'} 0 everywhere in "
        f"micro-batch {mb} of the step, in every sample: it is padding throughout (a segment past the end "
        "of every sequence of a batch padded to a fixed length; a bucket of short sequences), "
        "so the loss's mask (or its ignore_index) kept no target to average; skip a "
        "micro-batch with no target before the loss (if (target != pad).any()), or pad "
        "each batch to its own longest sequence")
