"""A sqrt at 0 in every sample, in backward, because a layer of the model started at zeros.

A spatial transformer's localisation head is zero-initialised with the identity transform in
its bias, so theta is exactly the identity for every crop at the first step; a regulariser
pulling theta towards the identity written as ``sqrt(((theta - I) ** 2).sum())`` is then 0 in
every sample: finite forward, but sqrt's derivative at 0 is +inf and the backward NaN. The
generic sqrt-at-0 hint lists points that coincide in the data; here no sample is to blame: the
distance is to the value the layer's bias starts the output at. Told apart as
:mod:`replay.zero_head` tells a loss's division: one forward and backward more with that weight
at small random values, whose gradients are finite.
"""

from __future__ import annotations

import torch

from .recorded import samples
from .rerun import Runner
from .zero_state import run_with_random, some_rows

ZERO_START = (
    "; here it is 0 in every sample because parameter {name} is all 0 as the step began: that "
    "layer outputs {what} for every input, and the distance is to the very value {that} "
    "starts it at ({example}); with small random values in that weight the backward is "
    "finite, so it is no sample's data: use torch.linalg.vector_norm or the squared distance, "
    "whose gradients at 0 are 0")
# (the layer's bias, or 0 for a layer without one)
_BIAS = {"what": "its bias", "that": "that bias",
         "example": "a regulariser pulling a spatial transformer's theta towards the identity "
                    "its head is initialised to"}
_NO_BIAS = {"what": "0", "that": "a zero weight",
            "example": "a penalty on the norm of the logits of a new head initialised to "
                       "zeros, a LoRA B matrix's output at 0"}


def zero_start_hint(runner: Runner, b, cause_name: str, hint: str) -> str:
    """``hint``, with the zero-initialised weight matrix that puts backward origin ``b``'s
    sqrt at 0 in every sample (see the module doc), when one does."""
    if cause_name != "invalid" or b.node != "SqrtBackward0" or b.saved_zero != "0" \
            or runner.model is None or not b.samples \
            or some_rows(b.samples, samples(runner.step, b.micro_batch or 0)):
        return hint
    runner.reset()
    zero = [(n, p) for n, p in runner.model.named_parameters() if p.requires_grad
            and p.is_floating_point() and p.dim() > 1 and not p.any()]
    for name, p in zero:  # (a matrix: a zero bias alone does not make a layer's output 0)
        if _finite_without(runner, p):
            return hint + ZERO_START.format(name=name, **(_BIAS if _has_bias(runner, name)
                                                          else _NO_BIAS))
    return hint


def _has_bias(runner: Runner, name: str) -> bool:
    """Whether the module holding parameter ``name`` has a bias beside it."""
    owner = name.rpartition(".")[0]
    try:
        module = runner.model.get_submodule(owner)
    except AttributeError:
        return True  # (the wording of old)
    return getattr(module, "bias", None) is not None


def _finite_without(runner: Runner, p: torch.Tensor) -> bool:
    """Are the step's loss and gradients finite with ``p`` at small random values?"""
    run = run_with_random(runner, p, backward=True)
    return bool(run.loss_finite) and all(run.loss_finite) and not run.bad_grads
