"""Blank ground truth of samples a 0/1 flag of the loss's marks unlabelled.

A mixed batch (SPIN's Human3.6M beside COCO) holds samples with no 3D label: their 3D joints
are a placeholder of zeros and ``has_3d`` is 0 there. A loss that runs an op on every sample
and multiplies by the flag afterwards (``pa_error * has_3d``, a Procrustes alignment whose
SVD of an all-zero covariance has tied singular values) keeps the op's NaN (NaN * 0 is NaN)
and, in backward, its pole (0 * inf); one that multiplies before the op (a gaze loss's
``sqrt(((pred - gt) * valid[:, None]) ** 2).sum(-1))``) puts the op at its pole. The flag may
be a model input the loss is given too (:mod:`replay.shared_inputs`). The records are not bad and nothing is to filter where
the data is made: :mod:`replay.zero_records` words its hint so when such a flag is 0 in
exactly the samples whose ground truth is blank.
"""

from __future__ import annotations

import torch

from recorder.capture import loss_path
from recorder.finite import zero_one

from .empty_records import zero_rows
from .load import Step
from .recorded import samples
from .shared_inputs import loss_input_refs


def label_flag(step: Step, mb: int, rows: list[int], blank: str) -> str | None:
    """The loss data argument other than ``blank`` holding one 0 or 1 per sample, 0 at every
    one of ``rows`` and 1 at every other sample (a ``has_3d``, ``has_smpl`` flag; not a dense
    validity mask, which is 0 all over an empty frame whose own mean over it is the op); also
    a model input the loss was given too (a ``valid`` mask passed to ``forward`` as well)."""
    entry, where = step.micro_batches[mb], samples(step, mb)
    made = set(entry.get("loss_grad_args") or ())
    given = [(key, loss_path(raw)) for key, raw in (entry.get("loss_paths") or {}).items()]
    for key, name in given + [(key, name) for name, key in loss_input_refs(step, mb)]:
        t = step.tensors.get(key)
        if key in made or name == blank or not isinstance(t, torch.Tensor) or t.is_complex() \
                or not t.numel() or (d := where.dim(t)) is None or t.numel() != t.shape[d]:
            continue
        if zero_one(t) and zero_rows(t, d, rows):
            return name
    return None


def unlabelled_hint(hint: str, blank_is: str, flag: str, which: str) -> str:
    """``hint`` with the samples' placeholder ground truth (``blank_is``: "t is", "t and u
    are") that ``flag`` weights 0 after the op."""
    return (
        f"{hint}. But {blank_is} 0 everywhere in sample(s) {which}, and {flag} (0/1 data) is "
        f"0 in exactly those samples: they carry no such label (a mixed dataset's 2D-only "
        "samples), their ground truth a placeholder of zeros, and the loss weights their "
        f"term by {flag}'s 0 while the op still runs on every sample: a product with 0 "
        "after the op keeps its NaN (NaN * 0 is NaN) and, in backward, its pole (0 * inf "
        "is NaN); one before it (the error times the flag, then its norm) puts the op's "
        "input at the pole. "
        f"Select the labelled samples before the op (x[{flag}.bool()]) instead of "
        "multiplying by the flag; the records are not bad, and an eps would leave the op "
        "running on placeholders")
