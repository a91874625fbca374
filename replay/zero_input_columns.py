"""Whole columns of a first layer's weight that an update made non-finite where the model
input feeding that layer is 0 in every sample.

A feature that never varies from 0 (a hyperspectral scene's water-absorption bands, which no
light reaches; a gene no cell of the dataset expresses; a sensor channel that is dead) gives
the weights reading it, a ``Linear``'s column, a gradient of exactly 0 at every step, and an
update that divides by its accumulated square (Adam with ``eps=0``: m / sqrt(v) = 0/0) makes
exactly those columns NaN. The optimizer's hint says what its eps does; this names the
columns and the input that left them without a gradient, so the user can drop the features
where the data is made. A layer that reads no root input as is (a tabular model's first
``Linear`` over ``cat([scaler(counts), one_hot(protocol)])``, a one-hot category the split
never holds) is found by its own input: the forward re-run to that layer, on the bundle's
batch, with the buffers it may write put back after.
"""

from __future__ import annotations

import torch

from .empty_counts import root_inputs
from .load import Step
from .looked_up_rows import forward_taking, owner_of

SHOWN = 8  # columns named in the hint


def zero_input_columns_text(step: Step, name: str, w: torch.Tensor) -> str:
    """``; the NaN fill whole column(s) ...`` when the non-finite entries of weight ``w``
    (``name``, 2-D, after the update) are or include whole columns, not all of them (the other
    entries counted), and a 2-D model input (else the layer's own input, :func:`_layer_input`)
    of as many features is 0 in every sample of every micro-batch in exactly those columns
    (nonzero somewhere in some other); else ``""``."""
    if w.dim() != 2 or not w.is_floating_point() or not w.numel():
        return ""
    bad = ~torch.isfinite(w.detach())
    whole = bad.all(0)
    if not bool(whole.any()) or bool(whole.all()):
        return ""
    rest = int((bad & ~whole).sum())  # (entries of a unit active only where a feature is 0)
    cols = whole.nonzero().flatten().tolist()
    found = _zero_features(step, w.shape[1])
    if not any(bool(z[cols].all()) and not bool(z.all()) for z in found.values()):
        found = _layer_input(step, name, w.shape[1])
    for input_name, zero in found.items():
        if bool(zero[cols].all()) and not bool(zero.all()):
            shown = ", ".join(map(str, cols[:SHOWN])) + (
                f" (+{len(cols) - SHOWN})" if len(cols) > SHOWN else "")
            return (f"; the non-finite entries {'include' if rest else 'are'} whole "
                    f"column(s) {shown} of {name}, the "
                    f"weights of feature(s) {shown} of {input_name}, which hold 0 in every "
                    "sample of the batch: a feature that never varies from 0 (a band no "
                    "light reaches, a gene no cell expresses, a dead sensor channel, a "
                    "one-hot category no record of the split holds) gives "
                    "its weights a gradient of exactly 0 at every step; drop such features "
                    "where the data is made" + (_REST.format(rest) if rest else ""))
    return ""


# the other non-finite entries beside those whole columns: no feature's, a unit's and a sparse
# input's (a hidden unit active only in records whose one-hot category is another)
_REST = ("; the {} other non-finite entr(ies) are weights whose gradient was 0 too, as a unit "
         "active only in records where the feature it reads is 0 (sparse or one-hot inputs) "
         "gets: only eps > 0 guards those")


def _zero_features(step: Step, width: int) -> dict[str, torch.Tensor]:
    """Readable name -> per feature, whether the 2-D ``(samples, width)`` model input of that
    name is 0 in every sample of every micro-batch that has it."""
    found: dict[str, torch.Tensor] = {}
    for mb in range(len(step.micro_batches)):
        for name, t, d in root_inputs(step, mb):
            if t.dim() == 2 and d == 0 and t.shape[1] == width:
                zero = (t.detach() == 0).all(0).cpu()
                found[name] = found[name] & zero if name in found else zero
    return found


def _layer_input(step: Step, name: str, width: int) -> dict[str, torch.Tensor]:
    """``{"<module>'s input": per feature, whether it is 0 in every row}`` of the input the
    module owning parameter ``name`` took (its first positional, ``(..., width)``) in every
    call of every micro-batch's forward, re-run on the bundle's batch; ``{}`` when there is no
    model, no such call or the forward cannot run."""
    module = owner_of(step, name)
    if module is None:
        return {}
    seen: list[torch.Tensor] = []

    def took(_module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.is_floating_point() and x.dim() >= 2 and x.shape[-1] == width:
            seen.append((x.detach().reshape(-1, width) == 0).all(0).cpu())

    if not forward_taking(step, module, took):  # (a forward that needs the loop's state)
        return {}
    if not seen:
        return {}
    zero = seen[0]
    for s in seen[1:]:
        zero = zero & s
    return {f"{name.rpartition('.')[0]}'s input": zero}
