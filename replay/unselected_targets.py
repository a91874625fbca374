"""A mean loss over no target where the labels were masked out, not padded.

Token-level labels ``(B, T)`` beside token ids of the same shape, ``-100`` at every position
while the ids hold real tokens: no row is padding (``replay.padding_batch`` names a batch that
is), the labelling itself selected nothing. Hugging Face training meets it in two ways: a
supervised fine-tuning batch whose prompts are masked with -100 and whose answers a
``max_length`` truncation cut off (long prompts sorted or bucketed together), and a masked-LM
collator's random choice of 15 % of the positions that picked none in a batch of short texts.
``cross_entropy``'s mean then divides by 0, or the model's sum by the Trainer's
``num_items_in_batch``, its count of labels that are not -100 (``replay.raw_pole``'s number
given with the batch). The op's advice, to skip such batches, is right but does not say where
the labels went; the hint names the tensors and the two writers.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

from .empty_records import batch_data
from .load import Step
from .raw_pole import SCALAR

_DETAIL = "every target of the batch is ignore_index ("
_COUNT = SCALAR.split("(", 1)[0].format(op="", what="").strip()


def unselected_targets_hint(report: dict[str, Any], step: Step) -> None:
    """Append where the ignored targets came from, where an ``invalid`` 0/0 of the loss had
    every target ``ignore_index`` and a token-id tensor of the labels' shape holds data."""
    o, hint = report.get("origin") or {}, report.get("hint") or ""
    counted = _COUNT in hint  # (the Trainer's num_items_in_batch of 0: raw_pole's SCALAR)
    if report.get("cause") != "invalid" or (_DETAIL not in hint and not counted):
        return
    ignore = _ignore_index(hint) if _DETAIL in hint else -100
    mb = o.get("micro_batch") or 0
    data = [(name, t) for name, t, _ in batch_data(step, mb) if not t.is_floating_point()]
    labels = [(n, t) for n, t in data if t.dtype != torch.bool and ignore is not None
              and bool(t.eq(ignore).all())]
    if not labels:
        return
    name, lab = labels[0]
    same = [(n, t) for n, t in data if t.shape == lab.shape and n != name]
    masks = [t for _, t in same if zero_one(t)]  # (a tokenizer's attention_mask)
    ids = [(n, t) for n, t in same if not zero_one(t) and bool(t.ne(0).any())]
    # (without an attention mask, id 0 may be a real token: a raw token stream's)
    real = int(masks[0].ne(0).sum()) if masks else ids[0][1].numel() if ids else 0
    if not ids or not real:  # (padding throughout: replay.padding_batch's)
        return
    id_name = ids[0][0]
    where = f"micro-batch {mb}" if len(step.micro_batches) > 1 else "the batch"
    tokens = f"{real} tokens that are not padding" if masks else f"tokens at all {real} positions"
    report["hint"] = (
        f"{hint}. Here {name} is {ignore} at all {lab.numel()} positions of {where} while "
        f"{id_name}, of the same shape, holds {tokens}: no padding "
        "batch, the labelling selected no position to predict (a fine-tuning example whose "
        f"prompt is labelled {ignore} and whose answer a max_length truncation cut off; a "
        "masked-LM collator's random choice of positions that picked none in a batch of short "
        "texts): drop examples left with no target where the data is made (truncate the "
        "prompt, not the answer), or skip a batch before the loss when "
        f"(labels != {ignore}).any() is false")


def _ignore_index(hint: str) -> int | None:
    """The ignore index the op's detail names (``ignore_index (-100)``)."""
    tail = hint.split(_DETAIL, 1)[1]
    try:
        return int(tail.split(")", 1)[0])
    except ValueError:
        return None
