"""A batch of padded sets (a slide's patch embeddings, a sequence's token features) whose
non-finite values fill whole elements, each a real one by the batch's padding mask (a 0/1
tensor over the same ``(samples, elements)``, some of it padding): a corrupted element of
precomputed features (a tile the feature extractor wrote as NaN), not a channel's
standardisation (``replay.whole_slices``) nor missing values stored as NaN
(``replay.masked_gaps``, whose mask marks mostly NaN). The mask may be a padding mask too,
True at the padding (a ``key_padding_mask``: an utterance's word vectors, one NaN for a word
out of the embedding's vocabulary), known by the tensor's 0s at every padded position."""

from __future__ import annotations

from typing import Any

import torch

from recorder.finite import zero_one

PADDED_ELEMENTS = (
    "the batch itself holds NaN/Inf, and {tensor} holds it in whole elements of its padded "
    "sets, each a real element by {mask} ({real}): {where}"
    ", every feature of each: one element's precomputed features are corrupt (a tile, a frame "
    "or a token whose embedding the feature extractor wrote non-finite), not a standardisation "
    "or the padding; find them in the feature files (torch.isfinite per element), re-extract "
    "or drop those elements (set {mask} False there) rather than add an eps downstream")


def padded_elements(t: torch.Tensor | None, where: str, tensor: str,
                    others: dict[str, Any]) -> str:
    """The hint when ``t``'s whole non-finite slices (``where``, by ``replay.whole_slices``,
    over dims 0 and 1) are True in a boolean tensor of ``others`` (name: batch tensor) of
    shape ``t.shape[:2]`` (all True at batch size 1: one slide, no padding), or in a 0/1
    tensor of that shape that has 0 entries (padding); "" otherwise."""
    if t is None or not where or t.dim() < 3:
        return ""
    bad = ~torch.isfinite(t.detach().reshape(*t.shape[:2], -1)).all(-1)
    for name, m in others.items():
        if not isinstance(m, torch.Tensor) or m is t or tuple(m.shape) != tuple(t.shape[:2]):
            continue
        if m.dtype != torch.bool and not zero_one(m):
            continue
        on = m.bool()
        if (m.dtype == torch.bool or not bool(on.all())) and not bool((bad & ~on).any()):
            return PADDED_ELEMENTS.format(tensor=tensor, mask=name, where=where, real=_KEEP)
        if _pads(t, on, bad):
            return PADDED_ELEMENTS.format(tensor=tensor, mask=name, where=where, real=_PADS)
    return ""


_KEEP = "its True/1 entries; any others are padding"
_PADS = "its False/0 entries; it is True at the padding, where the features are 0"


def _pads(t: torch.Tensor, pad: torch.Tensor, bad: torch.Tensor) -> bool:
    """``pad`` (samples, elements) is ``t``'s padding mask, True at the padding: set somewhere,
    ``t`` 0 at every set element, and no non-finite element set (a mask of another modality
    of the same shape is set where ``t`` holds features)."""
    if not bool(pad.any()) or bool((bad & pad).any()):
        return False
    return not bool(t.detach().reshape(*t.shape[:2], -1)[pad].ne(0).any())
