"""The recorder's hooks as registered on the model, the loss module, the optimizer and the
parameters: what a *copy* of one of those gets.

Training code copies models while they are recorded: ``copy.deepcopy(model)`` for an EMA or SWA
average (``torch.optim.swa_utils.AveragedModel``, Lightning's ``StochasticWeightAveraging`` and
``WeightAveraging``, timm's ``ModelEmaV2``), ``torch.save(model)`` for a whole-model checkpoint.
Both copy the hook dictionaries. A plain bound method or ``partial`` would drag the recorder in
(its locks and device buffers cannot be copied: the copy failed), and a shared one would record
the copy's forwards as the recorded model's. A :class:`Hook` becomes :func:`inert` in a copy:
the copy is not the recorded model. :class:`Health` is what every hook checks first, and what
turns the recorder off after an error of its own.
"""

from __future__ import annotations

import logging
from functools import partial

from .errors import first_line

log = logging.getLogger("nanreplay")


def inert(*args, **kwargs) -> None:
    """What a copied recorder hook does: nothing (``None`` leaves outputs and steps as they
    are)."""
    return None


def _inert() -> object:
    return inert


class Hook(partial):
    """A recorder hook: ``partial(fn, *args)``, copied and pickled as :func:`inert` (a pickled
    model then needs ``recorder`` importable to load, like any module whose hooks it holds)."""

    __slots__ = ()

    def __deepcopy__(self, memo) -> object:
        return inert

    def __copy__(self) -> object:
        return inert

    def __reduce__(self):
        return (_inert, ())


class Health:
    """Whether the recorder records: on from attach to detach, off after a raised event or an
    internal error of its own (a recorder bug must never stop training: logged once, and
    training continues unrecorded)."""

    __slots__ = ("active", "internal_errors")

    def __init__(self):
        self.active = False
        self.internal_errors = 0

    def internal_error(self, e: Exception) -> None:
        self.internal_errors += 1
        if self.internal_errors == 1:
            log.warning("nanreplay: recorder disabled after an internal error (%s: %s); "
                        "training continues unrecorded", type(e).__name__, first_line(e, 300))
        self.active = False
