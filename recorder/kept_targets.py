"""Whether the loss call a micro-batch keeps for the bundle took targets the loop wrote over
since. A loop may call the loss several times on one forward and write its target buffer
between the calls: dcgan's one ``label`` tensor, ``label.fill_(fake_label)`` for D's loss on the
fakes, then ``label.fill_(real_label)`` for the generator's loss on them. Until the event picks
the call it keeps (the first non-finite one), the recorder counts a write into any call's
targets (``MicroBatch.targets_moved``); once it has picked, only the kept call's matter: the
bundle holds its arguments alone, and targets written before that call took them are what
it took, so its loss is re-run."""

from __future__ import annotations

from .compat import version_of


def kept_targets_moved(mb) -> bool:
    """A target of the micro-batch's kept loss call was written in place since the call."""
    return any(version_of(t) != v for t, v in mb.loss_versions)


def settle_targets(micro_batches) -> None:
    """After the event chose each micro-batch's kept loss call: its targets changed only
    where that call's did (see the module's docstring)."""
    for mb in micro_batches:
        if mb.targets_changed and not kept_targets_moved(mb):
            mb.targets_changed = False
