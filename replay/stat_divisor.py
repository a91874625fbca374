"""A forward division whose divisor is one of the model's buffers as is (a statistic kept from
the data: a training set's per-feature std, ``(x - self.mean) / self.std``) and 0 in some
entries: a feature constant in the data the statistic was computed from (an EEG reference
electrode, 0 against itself). Every sample divides by it alike, so the generic advice (an eps
at the divisor, or skip the rows where it is 0) names no row to skip; the fix is where the
buffer is computed."""

from __future__ import annotations

import torch

from .domains import describe

SHOWN = 8  # entries named in the hint


def stat_divisor_hint(model: torch.nn.Module, finder, hit) -> str | None:
    """The hint naming the buffer the blamed division divided by and its entries at 0, when
    the op (``hit``) divided by that buffer as is; else None."""
    name, ev = finder.names.hit_divisor_table, hit and hit.evidence
    if name is None or hit is not finder.first or ev is None or len(ev.inputs) < 2 \
            or not bool((ev.inputs[1] == 0).any()):
        return None
    buf = dict(model.named_buffers()).get(name)
    if buf is None or not buf.is_floating_point():
        return None
    at = (buf.detach() == 0).nonzero()
    if not len(at):
        return None
    where = ", ".join(str(tuple(i)) if len(i) > 1 else str(i[0])
                      for i in at[:SHOWN].tolist()) + (f" (+{len(at) - SHOWN})"
                                                        if len(at) > SHOWN else "")
    what = describe(hit.op.removeprefix("aten."), ev)[0]
    return (f"{what}: the divisor is the model's buffer {name} as is, 0 at {where} of its "
            f"shape {tuple(buf.shape)}: a statistic kept from the data (a training set's "
            "std or scale), 0 for a feature constant in the data it was computed from (an "
            "EEG reference electrode, 0 against itself; a sensor never connected). Every "
            "sample divides by it alike, so no record is to blame and there are no rows to "
            "skip: floor it where it is computed (std.clamp_min(eps); scikit-learn's "
            "StandardScaler sets a zero scale to 1) or drop that feature from the inputs")
