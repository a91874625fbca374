"""Uneven inputs under ``torch.distributed.algorithms.join.Join``: the recorder as a joinable.

``Join([ddp])`` lets a rank that ran out of batches shadow DDP's collectives until every rank
is done. The recorder's own per-step all-reduce (each step's verdict, agreed across the ranks,
see ``recorder.ranks``) is not DDP's: a joined rank never ran it, so the ranks still training
waited for it in their first step after the join, or met DDP's shadowed all-reduce in its
place (gloo: a size mismatch). List the recorder after the model:

>>> with FlightRecorder(ddp, opt, loss_fn=crit) as rec:          # doctest: +SKIP
...     with Join([ddp, joinable(rec)]):
...         for x, y in loader: ...

A joined rank then matches each step's exchange of the ranks still training (and their slow
path's, when one of them saw a non-finite value: in raise mode it raises ``NonFiniteError``
at that step too, naming them, as a peer whose own values were finite; their bundles hold
the step).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from .errors import NonFiniteError

log = logging.getLogger("nanreplay")


class RecorderJoinable(Joinable):
    """A :class:`~recorder.FlightRecorder`'s agreement across ranks, for ``Join``."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def agreement(self):
        return self.recorder.target.ranks

    def join_hook(self, **kwargs) -> JoinHook:
        return _Shadow(self)

    @property
    def join_device(self) -> torch.device:
        ranks = self.agreement()
        return ranks.device if ranks is not None else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        ranks = self.agreement()  # (Join compares it with DDP's: the default group's object)
        group = ranks.group if ranks is not None else None
        return group if group is not None else torch.distributed.group.WORLD


class _Shadow(JoinHook):
    def __init__(self, joinable: RecorderJoinable):
        self.joinable = joinable
        self.warned = False

    def main_hook(self) -> None:
        ranks = self.joinable.agreement()
        rec = self.joinable.recorder
        if ranks is None or not rec.health.active:
            return
        seen, first, step = ranks.shadow()
        if ranks.left:
            rec.health.active = False
            return
        if not seen:
            return
        text = (f"nanreplay: rank(s) {', '.join(map(str, first or seen))} saw a non-finite "
                f"value at step {step} after this rank (rank {ranks.rank} of {ranks.world}) ran "
                "out of inputs under Join; their bundles hold the step")
        if rec.settings.on_event == "raise":
            rec.health.active = False
            event = {"phase": "peer", "step": step, "joined": True,
                     "ranks": {"rank": ranks.rank, "world_size": ranks.world,
                               "run_id": ranks.run_id, "seen_by": seen, "first": first}}
            raise NonFiniteError(text + "; every rank stopped at this step.", event=event)
        # warn mode: this rank's report of the event, as the others' alarm fired with theirs
        # (else, at detach, the weights the last joiner's update left would be its own event)
        rec.alarm.fired = True
        if not self.warned:
            self.warned = True
            log.warning("%s; every rank trains on (on_event=\"warn\").", text)


def joinable(recorder) -> RecorderJoinable:
    """The recorder as a ``Join`` joinable (list it after the DDP model). Refused with
    ``guard_optimizer=True``, whose second read per step a joined rank cannot tell from the
    next step's (it would shadow one collective too few)."""
    if recorder.settings.guard_optimizer:
        raise ValueError("nanreplay: joinable(recorder) cannot shadow guard_optimizer=True's "
                         "second read per step; record with guard_optimizer=False under Join")
    return RecorderJoinable(recorder)
