"""Tensor-parallel bundles: the recorded statistics of rank-local activation slices.

Under tensor parallelism (``parallelize_module``: ``ColwiseParallel`` then ``RowwiseParallel``)
the modules between a column- and a row-wise layer compute on this rank's slice of the hidden
units, and their hooks measured that slice (``recorder.shards``, the bundle's
``model.tensor_parallel``). The replay re-runs the step unsharded, on the full tensors: a
slice's (min, max) lies within the full tensor's, so a call is compared as contained in the
re-run's range, not equal to it. A value the training made from one slice alone (a reduction
over a sharded dimension) does not come back unsharded: the hint says so.

>>> within(-1.49, 1.28, (-1.49, 1.82), close)     # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SLICED_WHY = "a module computed on its rank's slice otherwise than the unsharded re-run"
SLICED = (
    "the model trained tensor-parallel, and this module's output on the rank's slice of its "
    "input is not a slice of its output on the whole (a norm, softmax, mean or max over a "
    "sharded dimension between a ColwiseParallel and a RowwiseParallel layer), which the "
    "replay re-runs unsharded: make its reductions span the full dimension (all-reduce them, "
    "or move the module out of the sharded region)")


def tensor_parallel(meta: dict[str, Any]) -> bool:
    """Whether the recorded model was tensor-parallel (bundles of this version and later)."""
    return bool((meta.get("model") or {}).get("tensor_parallel"))


def within(lo: float, hi: float, got: tuple[float, float],
           close: Callable[[float, float], bool]) -> bool:
    """Whether a recorded slice's (``lo``, ``hi``) lies within the re-run's full range ``got``
    (up to ``close``'s tolerance at either end)."""
    return (lo >= got[0] or close(lo, got[0])) and (hi <= got[1] or close(hi, got[1]))


def unsharded_hint(meta: dict[str, Any]) -> str | None:
    """The hint for a tensor-parallel step the unsharded re-run did not reproduce, else None."""
    if not tensor_parallel(meta):
        return None
    module = (meta.get("event") or {}).get("module")
    seen = f" (the recorder saw it made in '{module}')" if module else ""
    return (f"the model trained tensor-parallel and the replay re-runs it unsharded, on the full "
            f"activations{seen}: a value made from one rank's slice alone (a norm, softmax, mean or "
            "max over a sharded dimension between a ColwiseParallel and a RowwiseParallel "
            "layer) does not come back. Check that the reductions of the modules in the "
            "sharded region span the full dimension (all-reduce them, or move the module out "
            "of that region), or, if the event is of the data, re-run training from the step "
            "before with the same batch")
