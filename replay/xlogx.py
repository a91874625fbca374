"""A log's -inf at 0 multiplied by a 0 at the same entries: ``p * log(p)``.

An entropy bonus or a KL term over probabilities that are exactly 0 (the entries a mask's
-inf gave softmax: a pointer network's visited nodes) is 0 in the limit, but computed as a
product it is ``0 * -inf = NaN``. The data's own 0, not a 0/1 mask applied after the pole
(:func:`replay.masked_product.mask_after_pole`), so the fix is the form with that limit built
in, not an eps or an earlier mask. That form's gradient must be finite at 0 too: xlogy(p, p)'s
with respect to its second argument is p / p, NaN there, and entr's is -log(0) - 1.

A cross-entropy written out, ``-(t * log(p) + (1 - t) * log(1 - p))``, is that product too
where the prediction is exactly 0 or 1 and its target agrees (a matting net's alpha that the
trimap fuses to the known pixels' 0 and 1, a saturated sigmoid): but the 0 is the target's,
data (the op finder's lineage: no learned input), and the -inf a learned prediction's log;
the fix is the loss torch writes for it, not an entropy's xlogy.
"""

from __future__ import annotations

import torch

_LOGS = {"aten.log", "aten.log2", "aten.log10"}
TEXT = ("; then {op} multiplied that -inf by a 0 at the same entries (p * log(p): an entropy "
        "or KL term over probabilities that are exactly 0, the entries a mask's -inf gave "
        "softmax, a singular value of 0), and 0 * -inf is NaN though the term's limit is 0: "
        "compute it as torch.special.xlogy(p, p.clamp_min(tiny)) (tiny = "
        "torch.finfo(p.dtype).tiny), which is 0 there with a finite gradient, or from "
        "log_softmax with the masked terms zeroed by torch.where; not as xlogy(p, p) or "
        "torch.special.entr(p), also 0 there but with a NaN or infinite gradient at p = 0 "
        "that the backward of a p with gradients spreads")


# the 0 is a target's (data), the -inf a learned prediction's log: a cross-entropy written out
TARGET_TEXT = (
    "; then {op} multiplied that -inf by a target's 0 at the same entries (a cross-entropy "
    "written out, t * log(p) + (1 - t) * log(1 - p), where the prediction is exactly 0 or 1 "
    "and its target agrees: a saturated sigmoid, an output fused with or clamped to the known "
    "values), and 0 * -inf is NaN though the term is 0: use "
    "F.binary_cross_entropy_with_logits on the logits (or F.binary_cross_entropy, which "
    "clamps its logs at -100), or clamp the prediction into [eps, 1 - eps] before the log")


# a target's 0 wherever the log is -inf, and nowhere else: the target's own log (a KL term
# t * log(t / p)) or a prediction that agrees with it exactly (a fused output): both fixes
EITHER_TEXT = (
    "; then {op} multiplied that -inf by a target's 0 at the same entries, and 0 * -inf is "
    "NaN though the term is 0. Where the log's 0 is that target's own (a KL or entropy term "
    "over a target distribution with zeros, t * log(t / p)): compute it as "
    "torch.special.xlogy(t, t.clamp_min(tiny)) (tiny = torch.finfo(t.dtype).tiny), 0 there "
    "with a finite gradient; where it is a prediction exactly 0 or 1 beside a target that "
    "agrees (a cross-entropy written out, t * log(p) + (1 - t) * log(1 - p), an output fused "
    "with or clamped to the known values): F.binary_cross_entropy_with_logits on the logits, "
    "or clamp the prediction into [eps, 1 - eps] before the log")


def note(first, args, hit, met, lineage=None) -> None:
    """Note ``hit``'s product on ``first``'s evidence when ``first`` is a log that made -inf
    and the product's other factor is 0 wherever that -inf is (``met(x, factor, bad)``); with
    the op finder's ``lineage``, whether that factor is data and the -inf learned."""
    ev = first.evidence if first is not None else None
    if ev is None or first.op not in _LOGS or first.made != "-inf" or len(args) < 2:
        return
    with torch.no_grad():
        try:
            ends = [(a, b) for a, b in (args[:2], args[1::-1]) if met(a, b, torch.isneginf)]
        except RuntimeError:
            return
    if ends:
        ev.own_zero_after = f"{hit.op}" + (f" ({hit.source})" if hit.source else "")
        inf, factor = ends[0]
        if lineage is not None and isinstance(factor, torch.Tensor) \
                and lineage.of_data([factor]) and not lineage.of_data([inf]):
            ev.target_zero = "target" if _finite_where_zero(inf, factor) else "either"


def _finite_where_zero(logged: torch.Tensor, factor: torch.Tensor) -> bool:
    """Whether the log is finite at some entry where the factor is 0: its -inf is not made
    by the factor's own zeros (KL's t * log(t / p) is -inf wherever t is 0; a cross-entropy's
    target is 0 beside predictions short of it too)."""
    with torch.no_grad():
        try:
            return bool(((factor == 0) & ~torch.isneginf(logged)).any())
        except RuntimeError:  # (shapes that do not broadcast)
            return False


def context(ev) -> str:
    """The hint's addition for a log whose -inf a product took by a 0 (``""`` when none)."""
    if not ev.own_zero_after:
        return ""
    text = {"target": TARGET_TEXT, "either": EITHER_TEXT}.get(ev.target_zero, TEXT)
    return text.format(op=ev.own_zero_after)
