"""Which recorded data tensor holds the value a distribution refused, when that value is the
batch's data alone (``replay.refused_value``): the op that last wrote it is a copy or a cast
of that tensor (pytorch-forecasting's target, cast to float inside the metric: ``aten._to_copy``
at the root), which says less than the tensor itself (``batch["decoder_target"]``, the loss's
``target``). A model input or a loss argument of the value's shape holding the value's
entries, refused ones included, is named."""

from __future__ import annotations

import torch

from recorder.capture import batch_path, loss_path

from .load import Step
from .recorded import n_args


def data_tensor(step: Step, mb: int, value: torch.Tensor | None,
                valid: torch.Tensor | None) -> str | None:
    """The name of the first recorded tensor of micro-batch ``mb`` holding ``value`` (within
    a cast's rounding; its refused entries, where ``valid`` is False, exactly), None without
    one."""
    if value is None or valid is None or mb >= len(step.micro_batches):
        return None
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    named = [(k, batch_path(raw, count)) for k, raw in (entry.get("paths") or {}).items()]
    named += [(k, loss_path(raw)) for k, raw in (entry.get("loss_paths") or {}).items()]
    want = value.detach().double().cpu()  # (as a cast of it: to float64, and back)
    refused = ~valid.detach().cpu()
    for key, name in named:
        t = step.tensors.get(key)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == want.shape \
                and torch.allclose(t.detach().double().cpu(), want, rtol=1e-6, atol=0.0) \
                and torch.equal(t.detach().double().cpu()[refused], want[refused]):
            return name
    return None
