"""An ``invalid`` op in a module that ``torch.nn.utils.prune`` pruned by whole rows.

Structured pruning (``prune.ln_structured(m, "weight", amount, n, dim=0)``, a mask the loop
computes by rows) zeroes entire rows of a weight: the module's forward then takes a norm, a
sum or a mean over a row of zeros (a cosine classifier's ``w / w.norm(dim=1)``, a weight
standardisation's ``(w - mean) / std``) and divides by it, 0/0. That is no parameter trained
to 0 nor a buffer built so: it is the mask (``<module>.<name>_mask``) the loop applied, and
its zero rows are what to name. A hand-written mask (a buffer of the weight's shape the loop
recomputes from ``topk`` of ``|w|`` or movement scores) at 100 % sparsity is all 0 (or 0 in whole
rows: a global threshold that empties a neuron): the masked weight is 0 there, and renormalising
the kept weights (``w * ||w|| / ||w * mask||``, per layer or per row) divides by 0.
"""

from __future__ import annotations

import re

from recorder.finite import zero_one

from .load import Step

__all__ = ["empty_mask_hint", "pruned_rows_hint"]

_MASK = re.compile(r"^buffers/(?P<name>[^.]+)_mask$")


def pruned_rows_hint(step: Step, module: str | None, op: str | None) -> str | None:
    """The hint for an ``invalid`` op of ``module`` whose own weight a prune mask zeroes by
    whole rows (along dim 0), else None."""
    if module is None:
        return None
    head = f"buffers/{module}." if module else "buffers/"
    for key, mask in step.tensors.items():
        m = _MASK.match("buffers/" + key[len(head):]) if key.startswith(head) else None
        if m is None or f"weights/{module + '.' if module else ''}{m['name']}_orig" \
                not in step.tensors or mask.dim() < 2:
            continue
        zero = (mask.reshape(mask.shape[0], -1) == 0).all(1).nonzero().flatten().tolist()
        if not zero:
            continue
        name = f"{module + '.' if module else ''}{m['name']}"
        rows = f"{zero[:8]}" + (f" (+{len(zero) - 8})" if len(zero) > 8 else "")
        return (f"{op or 'an op'} in {module or 'the model'} made 0/0 where {name}'s prune "
                f"mask ({name}_mask, torch.nn.utils.prune) zeroes whole rows {rows} of "
                f"{mask.shape[0]}: a norm, sum or std over a row of zeros is 0, and the "
                "forward divides by it; clamp the divisor (w.norm(dim=1, keepdim=True)"
                ".clamp_min(eps), F.normalize), or drop the pruned rows' outputs instead of "
                "normalising them")
    return None


def empty_mask_hint(step: Step, module: str | None, op: str | None) -> str | None:
    """The hint for an ``invalid`` division in ``module`` whose own 0/1 buffer of a weight's
    shape, as the step began, is all 0 or 0 in whole rows (a pruning mask that keeps nothing
    of a layer or of a neuron), else None; not a state vector (a power iteration's ``u`` has a
    weight's row count, not its shape)."""
    if module is None or op not in ("aten.div", "aten.reciprocal", "aten.rsqrt"):
        return None
    prefix = f"{module}." if module else ""
    shapes = {t.shape: k[len("weights/" + prefix):] for k, t in step.tensors.items()
              if k.startswith("weights/" + prefix) and "." not in k[len("weights/" + prefix):]
              and t.dim() >= 2}
    for key, buf in step.tensors.items():
        name = key[len("buffers/" + prefix):]
        if not key.startswith("buffers/" + prefix) or "." in name or buf.shape not in shapes \
                or not buf.is_floating_point() or not zero_one(buf):
            continue
        weight = f"{prefix}{shapes[buf.shape]}"
        zero = (buf.reshape(buf.shape[0], -1) == 0).all(1).nonzero().flatten().tolist()
        if not zero:
            continue
        what = "all 0" if len(zero) == buf.shape[0] else f"0 in whole rows {zero[:8]}" + \
            (f" (+{len(zero) - 8})" if len(zero) > 8 else "") + f" of {buf.shape[0]}"
        return (f"{op}'s divisor is 0 because buffer {prefix}{name}, a 0/1 mask of {weight}'s "
                f"shape, is {what} as the step began: a mask that keeps no "
                "weight there (pruned to 100 % sparsity: a schedule's final sparsity of 1.0, "
                "a top-k or global threshold that keeps nothing of a layer or a neuron), so "
                "the masked weight and its norm are 0 and renormalising the kept weights by "
                "that norm divides by 0 (x/0, then 0 * inf or 0/0). Keep at least one weight "
                "per layer or row (cap the sparsity below 1, k = max(1, ...)) and skip the "
                "rescaling where the masked norm is 0; an eps on the divisor keeps it at 0")
    return None
