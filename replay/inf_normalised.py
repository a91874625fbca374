"""A loss argument NaN in a few samples and exactly 0 in every other: a normalisation by an
infinite total.

Prioritized replay's importance weights ``w = (N * P(i)) ** -beta; w / w.max()``: a sampled
transition of priority 0 has ``0 ** -beta = inf``, the max is inf, and the division gives
``inf / inf = NaN`` there and ``finite / inf = 0`` for every other sample. The input event
names the NaN samples; the 0s beside them (each a sample the loss silently stops learning
from) say where the NaN came from: a ``/ max`` or ``/ sum`` over a value that was infinite,
which is the thing to fix, not the NaN's samples' data. A weight per class (a focal or
cross-entropy ``weight=`` of inverse class frequencies counted on the batch: ``total / count``
of a class the batch lacks is inf) shows the same pattern over classes, not samples.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import loss_path

from .load import Step


def inf_normalised_hint(report: dict[str, Any], step: Step) -> None:
    """Add to an ``input`` event's hint when the loss argument it names (``origin.tensor``)
    is NaN at its samples and exactly 0 in every finite entry, some entries finite."""
    o = report["origin"]
    name, mb = o.get("tensor"), o.get("micro_batch") or 0
    if report.get("cause") != "input" or not isinstance(name, str) \
            or not name.startswith(("loss_args", "loss_kwargs")) \
            or mb >= len(step.micro_batches):
        return
    entry = step.micro_batches[mb]
    for key, raw in (entry.get("loss_paths") or {}).items():
        t = step.tensors.get(key)
        if loss_path(raw) == name and isinstance(t, torch.Tensor) and _pattern(t):
            per_class = _per_class(t, o.get("batch_size"))
            report["hint"] = (report.get("hint") or "") + (
                f"; every finite entry of {name} is exactly 0, beside its NaNs: the mark of "
                "a normalisation by an infinite total (w / w.max() or w / w.sum() where some "
                "w is inf: inf / inf is NaN there, finite / inf is 0 everywhere else, so the "
                f"other {'classes' if per_class else 'samples'} stop counting too). Look for "
                "the infinity before that division: " + (
                    _per_class_text(name, t, o["batch_size"]) if per_class else _PER_SAMPLE))
            return


_PER_SAMPLE = (
    "prioritized replay's importance weight (N · P(i))^−β of a transition of priority 0 is "
    "0^−β = inf; keep priorities above 0 where the weights read them (|δ| + eps, the eps the "
    "sampling adds), or compute the weights in log space")


def _per_class(t: torch.Tensor, batch_size) -> bool:
    """One weight per class (or channel), not per sample: a vector, or a view broadcast
    over the samples' other dimensions ``(1, C, 1, 1)``, whose length is not the batch's."""
    sizes = [n for n in t.shape if n != 1]
    return len(sizes) == 1 and (t.dim() == 1 or t.shape[0] == 1) \
        and isinstance(batch_size, int) and sizes[0] != batch_size


def _per_class_text(name: str, t: torch.Tensor, batch_size: int) -> str:
    nan = torch.isnan(t.flatten()).nonzero().flatten().tolist()
    return (f"{name} holds {t.numel()} entries, one per class (not one per sample of the "
            f"{batch_size}), NaN at class(es) {nan}: an inverse class frequency (total / count, 1 / count, count ** -0.5) "
            "of a class that no sample or pixel of this batch holds is x / 0 = inf; count "
            "the classes over the training set, not per batch, or keep each count above 0 "
            "(counts.clamp_min(1), counts + 1)")


def _pattern(t: torch.Tensor) -> bool:
    if not t.is_floating_point() or t.numel() < 2:
        return False
    nan, finite = torch.isnan(t), torch.isfinite(t)
    return bool(nan.any()) and bool(finite.any()) and bool((nan | finite).all()) \
        and not bool(t[finite].any())
