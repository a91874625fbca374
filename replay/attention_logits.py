"""A matrix product that overflowed a half type where the chain's next op is a softmax: the
attention scores ``q @ k.transpose(-1, -2)`` (x-transformers' ``einsum('b h i d, b h j d ->
b h i j', q, k)``, a bmm), then ``softmax`` of their +-inf is NaN.

The generic advice for a float16 overflow (compute the op in float32, bfloat16, rescale its
inputs) is right but misses why attention scores grow: their size is the product of the
query and key projections' norms, which grow in training (attention-logit growth, Dehghani et
al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"), and a scale applied to the
scores after the product (``sim * dim_head ** -0.5``) comes after the overflow. The fix the
field uses is a normalisation of queries and keys (QK-norm), which the libraries offer as a
switch.
"""

from __future__ import annotations

__all__ = ["attention_logits_hint"]

_PRODUCTS = {"aten.bmm", "aten.mm", "aten.matmul", "aten.baddbmm", "aten.einsum"}
_SOFTMAX = {"aten._softmax", "aten.softmax", "aten._safe_softmax", "aten._log_softmax"}
_HALF = {"float16", "bfloat16"}

ADVICE = ("; a softmax takes its result (the chain's next op): these are attention scores, "
          "q . k over the head's dimension, whose size is the product of the queries' and "
          "keys' norms, which grow with the query and key projections' weights in training "
          "(attention-logit growth); a scale applied to the scores after the product "
          "(sim * dim_head ** -0.5) comes after the overflow: normalise queries and keys "
          "(QK-norm: x-transformers' attn_qk_norm=True, timm's qk_norm=True), scale q before "
          "the product (F.scaled_dot_product_attention does), or compute the scores in float32")


def attention_logits_hint(hint: str | None, cause: str | None, origin: dict) -> str | None:
    """``hint`` with the advice for attention scores when the origin is a matrix product that
    overflowed a half type and the chain's next op is a softmax; else ``hint``."""
    chain = origin.get("chain") or []
    if hint is None or cause != "overflow" or len(chain) < 2:
        return hint
    first, then = chain[0], chain[1]
    if first.get("op") not in _PRODUCTS or first.get("dtype") not in _HALF \
            or then.get("op") not in _SOFTMAX:
        return hint
    return hint + ADVICE
