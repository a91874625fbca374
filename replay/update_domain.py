"""An update whose own formula took an op out of its domain (a hand-written optimizer's 0/0).

LAMB's and LARS's trust ratio ||w|| / ||update|| of a zero-initialised parameter that got no
gradient, normalised SGD's g / ||g|| of a zero gradient, Adafactor's rsqrt of a factored second
moment of 0: the update's op made NaN or Inf from finite weights, gradients and state. No
learning rate or clipping changes such a value (a fraction of 0/0 is still 0/0), so the hint
names the op's values, as a forward op's cause does, and ``--try auto`` proposes neither.
"""

from __future__ import annotations

import torch
from torch import nn

from recorder.finite import bad_rows

from . import domains
from .cause_text import DO
from .ops import OpHit

__all__ = ["update_domain", "domain_why", "updated_rows", "rows_of_weights", "owner_type"]

# torch's layers whose weight rows (dim 0) are output units, not entries looked up per sample
UNIT_ROWS = ("torch.nn.modules.linear.", "torch.nn.modules.conv.")


def update_domain(hit: OpHit | None) -> str | None:
    """What the update's op was given where it left its domain ("aten.div of 0 by 0
    (0/0)"), with the advice that fits; None for an op without a pole or domain (an overflow
    of ``p - lr * u``, which a smaller rate does change) or one given infinities."""
    if hit is None or hit.evidence is None or not hit.inputs_finite:
        return None
    name = hit.op.removeprefix("aten.")
    if domains.no_pole(name, hit.evidence):
        return None
    what, situation = domains.describe(name, hit.evidence)
    return f"{what}: {DO.get(situation, DO['pole'])}"


def negative_input(domain: str | None) -> bool:
    """Whether ``domain`` is a root, power or log of a negative number (not a division's
    pole, which an eps in the denominator does move)."""
    return bool(domain) and " of a negative number" in domain and "at a pole" not in domain


def domain_why(domain: str) -> str:
    """The hint's reason for an update that left an op's domain."""
    why = (f"{domain}. The update's own formula made it, whatever the learning rate: a "
           "smaller rate or clipping does not remove it")
    if negative_input(domain):  # a root of an eigenvalue that rounded below 0
        return (f"{why} (a preconditioner's inverse root, Shampoo's or SOAP's eigh(G G^T) ** "
                "-1/4, of an eigenvalue that rounding left slightly negative: clamp the "
                "eigenvalues, lam.clamp_min(eps), before the power)")
    return (f"{why} (a parameter that got no gradient this step, or a freshly "
            "zero-initialised one, makes the 0 that a trust ratio ||w|| / ||update|| or a "
            "g / ||g|| divides by; LAMB and LARS take a ratio of 1 there: "
            "torch.where(norm > 0, ratio, 1.0))")


def updated_rows(name: str, p: torch.Tensor, owner: str | None = None,
                 model: nn.Module | None = None, looked_up: set[int] | None = None
                 ) -> tuple[dict, str]:
    """The rows (dim 0) of parameter ``name`` that the re-run update made non-finite, when only
    some are (an embedding table's entities), as the origin's ``rows``/``rows_of`` and the
    hint's words, which say when their gradient was all 0 there (rows absent from the batch:
    the 0 a Riemannian expmap's u / ||u|| or a g / ||g|| divides by; an embedding's padding
    row, found in ``model``; output units no loss reached, where ``owner``, the holding
    module's class, is a Linear or a convolution); ({}, "") otherwise."""
    return rows_of_weights(name, p.detach(), p.grad, owner=owner, model=model,
                           looked_up=looked_up)


def owner_type(meta: dict, name: str) -> str | None:
    """The class (``module.QualName``) of the module that holds parameter ``name``, from the
    bundle's ``modules``; None when it is not listed."""
    owner = name.rpartition(".")[0]
    return next((m.get("type") for m in meta.get("modules") or [] if m.get("name") == owner),
                None)


def _zero_rows(owner: str | None, rows: list[int], looked_up: set[int] | None) -> str:
    """Why a row's gradient was all 0: an entry no sample looked up (or one looked up only
    where the loss did not reach, when ``looked_up``, the rows the batch looked up, has it),
    or, for a layer whose rows are output units, a unit no sample's loss reached."""
    if owner is None or not owner.startswith(UNIT_ROWS):
        return f" ({_absent(rows, looked_up)})"
    return (" (an output unit no sample's loss reached: a logit the loss never takes, as the "
            "Q-value of an action no transition of the batch took or a class no label names, "
            "or a unit a ReLU closed on the whole batch)")


def rows_of_weights(name: str, w: torch.Tensor, g: torch.Tensor | None,
                    first: torch.Tensor | None = None, owner: str | None = None,
                    model: nn.Module | None = None, looked_up: set[int] | None = None
                    ) -> tuple[dict, str]:
    """:func:`updated_rows` of weights ``w`` after the update and the gradient ``g`` it was
    given (a bundle that holds the weights after the update: its recorded gradient, or the
    second moment the update left, with ``first`` the first moment: a second moment 0 where
    the first is not is a gradient whose square underflowed, not one that was 0); ``looked_up``:
    an embedding table's rows the batch looked up (``replay.looked_up_rows``)."""
    if w.dim() < 2:
        return {}, ""
    rows = bad_rows(w, 0)
    if not 0 < len(rows) < w.shape[0]:
        return {}, ""
    shown = ", ".join(map(str, rows[:8])) + (f" (+{len(rows) - 8})" if len(rows) > 8 else "")
    g = g.to_dense() if g is not None and g.layout != torch.strided else g
    zero = g is not None and bool((g[rows] == 0).all())
    lost = zero and first is not None and first.shape == g.shape and bool(
        (first[rows] != 0).any())
    return ({"rows": rows, "rows_of": w.shape[0]},
            f"; it made only row(s) {shown} of {w.shape[0]} of {name} non-finite"
            + (_underflowed(g.dtype) if lost else
               ", every one a row whose gradient was all 0" + (
                   _padding_rows(model, name, rows, looked_up)
                   or _zero_rows(owner, rows, looked_up))
               if zero else ""))


def _padding_rows(model: nn.Module | None, name: str, rows: list[int],
                  looked_up: set[int] | None) -> str:
    """Why rows of an embedding table got a gradient of 0 when one is the table's padding row
    (``nn.Embedding(..., padding_idx=0)``, an "unknown" category's row), whose gradient the
    embedding keeps at 0 whatever ids the batch holds; '' for any other rows."""
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if model is not None else None
    except AttributeError:
        owner = None
    pad = getattr(owner, "padding_idx", None)
    if attr != "weight" or not isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) \
            or pad not in rows:
        return ""
    where = (f"{owner_name}'s padding row, padding_idx={pad}, which {type(owner).__name__} "
             "never gives a gradient, whatever ids the batch holds")
    others = [r for r in rows if r != pad]
    return f" ({where})" if not others else f" ({where}; {_absent(others, looked_up, 'the others')})"


def _absent(rows: list[int], looked_up: set[int] | None, these: str = "") -> str:
    """``absent from the batch``, unless ``looked_up`` (the ids the table took) holds some of
    ``rows``: those were looked up, at positions whose output no loss reached."""
    taken = sorted(set(rows) & looked_up) if looked_up is not None else []
    if not taken:
        return f"{these} absent from the batch".lstrip()
    shown = ", ".join(map(str, taken[:8])) + (f" (+{len(taken) - 8})" if len(taken) > 8 else "")
    rest = "; the others absent from the batch" if len(taken) < len(rows) else ""
    return (f"row(s) {shown} looked up by the batch only at positions whose output no loss "
            "reached: a padding id zeroed by a mask, embed(ids) * mask, instead of padding_idx, "
            "or a token cut off before the loss" + rest)


def _underflowed(dtype: torch.dtype) -> str:
    return (f", every one a row whose second moment was all 0 while its first moment was not: "
            f"their gradients were not 0 but too small to square in {str(dtype)[6:]} ((1 - "
            "beta2) g ** 2 under its smallest value), not rows absent from the batch")
