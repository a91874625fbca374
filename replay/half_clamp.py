"""A clamp inside (-1, 1) in a half type: the eps the advice names for float32 is no eps there.

The advice for atanh, erfinv and the unit-domain ops (``DO["atanh"]``: ``x.clamp(-1 + 1e-5,
1 - 1e-5)``) gives a float32 eps. An op taken in bfloat16 or float16 (under autocast, a hash
layer's ``tanh(beta * x)`` read back through ``atanh``) rounds ``1 - 1e-5`` to 1: bfloat16's
nearest number below 1 is ``1 - 2^-8`` (0.996), float16's ``1 - 2^-11`` (0.9995). The clamp
then keeps the pole; its eps must be at least that spacing, or the op taken in float32.
"""

from __future__ import annotations

import torch

# the advice keys (``DO``) whose fix clamps the input short of +-1
NEAR_ONE = ("atanh", "erfinv", "unit")


def advice(situation: str, dtype: torch.dtype) -> str:
    """What to add to ``situation``'s advice for an op in ``dtype`` (``""`` unless a clamp
    short of +-1 in a type coarser than float32)."""
    if situation not in NEAR_ONE or not dtype.is_floating_point or \
            torch.finfo(dtype).bits >= 32:
        return ""
    below = torch.finfo(dtype).eps / 2  # the spacing just below 1
    name = str(dtype).removeprefix("torch.")
    return (f"; but the op ran in {name}, whose nearest number below 1 is {1 - below:g}: a "
            f"float32 eps (1 - 1e-5) rounds to 1 there, so clamp with an eps of at least "
            f"{below:.2g} in {name} (x.clamp(-1 + {2 * below:.1g}, 1 - {2 * below:.1g})) or take "
            f"the op in float32 (x.float(), outside autocast's reach)")
