"""A matrix product that overflowed a half type where the chain's next op is a softmax: the
attention scores ``q @ k.transpose(-1, -2)`` (x-transformers' ``einsum('b h i d, b h j d ->
b h i j', q, k)``, a bmm), then ``softmax`` of their +-inf is NaN.

The generic advice for a float16 overflow (compute the op in float32, bfloat16, rescale its
inputs) is right but misses why attention scores grow: their size is the product of the
query and key projections' norms, which grow in training (attention-logit growth, Dehghani et
al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"), and a scale applied to the
scores after the product (``sim * dim_head ** -0.5``) comes after the overflow. The fix the
field uses is a normalisation of queries and keys (QK-norm), which the libraries offer as a
switch. At the first step the recorder saw no update has run yet: the scores are that
large from the weights as built or loaded (an init's std of 1 or ``sqrt(d)`` where 0.02 or
``d ** -0.5`` was meant, or a checkpoint's grown projections), and the hint says so.
"""

from __future__ import annotations

from .param_writes import first_recorded

__all__ = ["attention_logits_hint"]

_PRODUCTS = {"aten.bmm", "aten.mm", "aten.matmul", "aten.baddbmm", "aten.einsum"}
_SOFTMAX = {"aten._softmax", "aten.softmax", "aten._safe_softmax", "aten._log_softmax"}
_HALF = {"float16", "bfloat16"}

SCORES = ("; a softmax takes its result (the chain's next op): these are attention scores, "
          "q . k over the head's dimension, whose size is the product of the queries' and "
          "keys' norms, ")
GROWN = ("which grow with the query and key projections' weights in training "
         "(attention-logit growth)")
UNTRAINED = ("which scale with the query and key projections' weights; no update ran under "
             "the recorder before this step (the first it saw), so they were that large as "
             "the model was built or loaded: check the init's std of those projections (0.02, "
             "or d ** -0.5 of their input width d, not 1 or d ** 0.5) or, loaded from a "
             "checkpoint, the attention-logit growth of its training")
ADVICE = ("; a scale applied to the scores after the product "
          "(sim * dim_head ** -0.5) comes after the overflow: normalise queries and keys "
          "(QK-norm: x-transformers' attn_qk_norm=True, timm's qk_norm=True), scale q before "
          "the product (F.scaled_dot_product_attention does), or compute the scores in float32")


def attention_logits_hint(hint: str | None, cause: str | None, origin: dict,
                          step=None) -> str | None:
    """``hint`` with the advice for attention scores when the origin is a matrix product that
    overflowed a half type and the chain's next op is a softmax; else ``hint``. ``step``
    (the bundle's :class:`~replay.load.Step`) tells whether an update ran before."""
    chain = origin.get("chain") or []
    if hint is None or cause != "overflow" or len(chain) < 2:
        return hint
    first, then = chain[0], chain[1]
    if first.get("op") not in _PRODUCTS or first.get("dtype") not in _HALF \
            or then.get("op") not in _SOFTMAX:
        return hint
    untrained = step is not None and first_recorded(step)
    return hint + SCORES + (UNTRAINED if untrained else GROWN) + ADVICE
