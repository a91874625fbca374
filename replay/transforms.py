"""Module calls made under a ``torch.func`` transform are not the recorded calls.

A forward may run a submodule under ``vmap``/``jacrev``/``grad`` (a contractive penalty's
``vmap(jacrev(self.enc))(x)``, the encoder's Jacobian per sample, beside its plain call). The
recorder's hooks skip such calls: their tensors are functorch's wrappers, which have no storage
to read, and the transform's levels are not the step's graph. The replay's module hooks skip them
the same way, so that a re-run numbers the calls as the recorder did (the fidelity check and the
bisection count them) and labels the autograd nodes of the step's own graph only.
"""

from __future__ import annotations

import functools

from .compat import func_transform


def outside_transforms(hook):
    """``hook`` (a module hook), run only for a call made outside every torch.func transform."""
    @functools.wraps(hook)
    def skipping(*args, **kwargs):
        if func_transform() is None:
            return hook(*args, **kwargs)
        return None
    return skipping
