"""Parameters the model gained after the recorder attached, named in the bundle.

A block appended to an ``nn.ModuleList`` (progressive growing), a new task head, a
``weight_norm`` registered mid-run (its ``original0``/``original1``, or the old hook-based
``weight_g``/``weight_v``, replace ``weight`` with new tensors): the recorder's parameters are
those the model had at attach (followed by name when swapped, by identity when renamed), so
these are neither hooked, checked nor bundled. At an event (the slow path) the bundle names
them, and those the model no longer holds, so that the replay says why its model is not the
one that ran rather than that the factory builds another.
"""

from __future__ import annotations

from torch import nn

from .target import LOSS_PREFIX


def added_after_attach(model: nn.Module, params: list) -> dict[str, list[str]]:
    """``{"added": names the model has that the recorder does not hold, "gone": recorded
    names whose tensors the model no longer holds (not the loss's own, ``<loss>.NAME``)}``,
    each only when not empty."""
    held = {id(p) for _, p in params}
    now = {id(p): n for n, p in model.named_parameters() if not p.is_meta}  # (as at attach)
    out = {"added": [n for i, n in now.items() if i not in held],
           "gone": [n for n, p in params if id(p) not in now and not n.startswith(LOSS_PREFIX)]}
    return {k: v for k, v in out.items() if v}
