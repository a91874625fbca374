"""Uneven inputs under ``torch.distributed.algorithms.join.Join``: the recorder's agreement
shadowed beside DDP's all-reduce.

``Join([ddp])`` lets a rank that ran out of batches shadow DDP's collectives until every rank
is done. The recorder's own per-step all-reduce (each step's verdict, agreed across the ranks,
see ``recorder.ranks``) is not DDP's: a joined rank never ran it, so the ranks still training
waited for it in their first step after the join (training hung), or met DDP's shadowed
all-reduce in its place (gloo: a size mismatch). So while the recorder is attached to a DDP
model with more than one rank, that DDP instance's ``join_hook`` (which ``Join`` calls as it is
built) returns DDP's own hook followed by the recorder's: the user's ``Join([ddp])`` stays as
it is, and detach puts DDP's method back.

A joined rank then matches each step's exchange of the ranks still training (and their slow
path's, when one of them saw a non-finite value: in raise mode it raises ``NonFiniteError`` at
that step too, naming them, as a peer whose own values were finite; their bundles hold the
step). ``guard_optimizer=True`` reads a second time per step, which a joined rank cannot tell
from the next step's: ``Join`` is refused there in one line instead of hanging (a ``Join``
entered before the recorder: the recorder, as it attaches).
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook

from .compat import join_entered, join_parts
from .compiled import compiled_module, is_compile_wrapper
from .errors import NonFiniteError

log = logging.getLogger("nanreplay")

REFUSED = ("nanreplay: Join cannot shadow guard_optimizer=True's second read per step (the "
           "ranks still training would wait for it); record with guard_optimizer=False under "
           "Join")


def ddp_in(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel instance ``model`` is or wraps (under ``torch.compile`` or
    DataParallel), else None."""
    while not isinstance(model, nn.parallel.DistributedDataParallel):
        if is_compile_wrapper(model):
            model = compiled_module(model)
        elif isinstance(model, nn.DataParallel):
            model = model.module
        else:
            return None
    return model


def join_along(ddp: nn.parallel.DistributedDataParallel | None, recorder) -> list:
    """Make ``ddp``'s ``Join`` hook shadow ``recorder``'s agreement too (see the module doc),
    when it runs under torch.distributed with more than one rank; returns the handles whose
    ``remove()`` undoes it, and tells the other ranks at detach that this one's recorder
    detached (``Agreement.depart``: a rank whose training ends first, a ``with`` block closed
    inside ``Join``)."""
    ranks = recorder.target.ranks
    if ranks is None:
        return []
    if ddp is None:
        return [_Depart(ranks)]
    own = ddp.join_hook

    def join_hook(**kwargs) -> JoinHook:
        if recorder.settings.guard_optimizer:
            raise ValueError(REFUSED)
        return _Shadowed(own(**kwargs), recorder)

    ddp.join_hook = join_hook  # (the instance's: DDP's class and other instances unchanged)
    within_join(ddp, recorder)
    return [_Restore(ddp, join_hook), _Depart(ranks)]


def refuse_guarded_join(ddp: nn.parallel.DistributedDataParallel | None, settings) -> None:
    """Attached inside ``with Join([ddp]):`` with ``guard_optimizer=True``: refused before any
    hook is registered, as a Join built after the recorder is (:data:`REFUSED`)."""
    if ddp is not None and settings.guard_optimizer and join_entered(ddp) \
            and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(REFUSED)


def within_join(ddp: nn.parallel.DistributedDataParallel, recorder) -> None:
    """Attached inside ``with Join([ddp]):`` (built before the recorder, with DDP's own hook):
    that Join's hook is made to shadow the recorder too, and the agreement's reads at the
    recorder's exit are local, its departure said from the hook. A rank whose inputs ran out
    left the recorder's block first: its exit's all-reduce met the others' Join
    all-reduce in their next step (the run hung). The hook stays in that Join, which ends
    with the block that holds the recorder's."""
    if not join_entered(ddp):
        return
    for join in _joins_holding(ddp):
        joinables, hooks = join_parts(join)
        for i, joinable in enumerate(joinables):
            if joinable is ddp and not isinstance(hooks[i], _Shadowed):
                hooks[i] = _Shadowed(hooks[i], recorder)
                recorder.target.ranks.in_join = True


def _joins_holding(ddp: nn.Module) -> list[Join]:
    """The live ``Join`` objects whose joinables list holds ``ddp`` (from its referrers)."""
    found = []
    for ref in gc.get_referrers(ddp):
        if isinstance(ref, list):
            for owner in gc.get_referrers(ref):
                if isinstance(owner, dict):
                    found += [o for o in gc.get_referrers(owner) if isinstance(o, Join)]
                elif isinstance(owner, Join):
                    found.append(owner)
    return list({id(j): j for j in found
                 if any(x is ddp for x in join_parts(j)[0])}.values())


class _Restore:
    def __init__(self, ddp: nn.Module, hook):
        self.ddp, self.hook = weakref.ref(ddp), hook

    def remove(self) -> None:
        ddp = self.ddp()
        if ddp is not None and vars(ddp).get("join_hook") is self.hook:
            del vars(ddp)["join_hook"]


class _Depart:
    def __init__(self, ranks):
        self.ranks = ranks

    def remove(self) -> None:
        self.ranks.depart()


class _Shadowed(JoinHook):
    """DDP's join hook, then the shadow of the recorder's step agreement."""

    def __init__(self, ddp_hook: JoinHook, recorder):
        self.ddp_hook, self.recorder = ddp_hook, recorder
        self.ranks = recorder.target.ranks  # (kept: detach drops the target's)
        self.warned = False

    def main_hook(self) -> None:
        self.ddp_hook.main_hook()
        rec, ranks = self.recorder, self.ranks
        if ranks is not None and ranks.depart_pending:  # (its block ended inside Join)
            ranks.depart_pending = ranks.in_join = False
            ranks.depart()
            return
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
            ranks.wrote(event["ranks"], step)  # (none of its own: the others' are written)
            raise NonFiniteError(text + "; every rank stopped at this step.", event=event)
        # warn mode: this rank's report of the event, as the others' alarm fired with theirs
        # (else, at detach, the weights the last joiner's update left would be its own event)
        rec.alarm.fired = True
        if not self.warned:
            self.warned = True
            log.warning("%s; every rank trains on (on_event=\"warn\").", text)

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp_hook.post_hook(is_last_joiner)
