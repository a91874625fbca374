"""Agreement across the ranks of a distributed run: a run id, and one verdict per step.

Under ``torch.distributed`` (DDP, FSDP2) a NaN seen on one rank must stop every rank at the
same step: a rank that raised alone would leave the others waiting in their next collective
(gloo fails it, NCCL hangs until the watchdog). So each step's local verdict (the probe, see
``recorder.cycle``) is combined with one small all-reduce of per-rank flags, enqueued on the
device before the step's single host read, which then reads the probe and the flags together:
every rank learns at the same step which ranks saw a non-finite value, and all of them enter
the slow path. There each rank finds its own event (or none) and one more all-reduce, run by
every rank in the same order, tells all of them which rank saw the event first.

>>> agreement = Agreement.join(torch.device("cpu"))   # doctest: +SKIP
>>> agreement.run_id, agreement.rank, agreement.world  # doctest: +SKIP
('9f0c2d5e7a31b4c8', 1, 2)

``join`` meets every rank in the process group's store (no device collective): rank 0's key
holds the run id, from ``os.urandom`` (torch's RNG is never consumed). Every rank must attach a
recorder; when one does not within ``NANREPLAY_ATTACH_TIMEOUT`` seconds (default 60), the
others' ``attach`` fails in one line naming the missing ranks, instead of every rank waiting in
its first step's collective until the process group's timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
from datetime import timedelta
from typing import Any

import torch

from .compat import process_group_store
from .events import Event

# the order in which a step's phases run: an earlier phase saw the event first
PHASE_ORDER = {"weights": 0, "input": 1, "forward": 2, "loss": 3, "backward": 4,
               "optimizer": 5}
_PHASE_NAMES = {v: k for k, v in PHASE_ORDER.items()}
_LATE = len(PHASE_ORDER)  # a rank whose own values were finite, or an unknown phase
STOPPED = 2.0  # a rank's flag when its recorder stopped after an error of its own
DEPARTED = 3.0  # a rank's flag when its recorder detached (see Agreement.depart)

log = logging.getLogger("nanreplay")

TIMEOUT_ENV = "NANREPLAY_ATTACH_TIMEOUT"  # seconds a rank's attach waits for the others
_TIMEOUT_S = 60.0
# how long a rank waits for the first ranks' bundles, then for the others' (see wrote)
_FIRST_WAIT_S, _PEERS_WAIT_S = 1800.0, 60.0
_last_work: list[Any] = [None]  # (see Agreement._all_reduce)
_joins = itertools.count()  # every rank attaches its recorders in the same order


class Agreement:
    """One process group's ranks, agreeing on each step's verdict; None when not distributed
    (see :meth:`join`)."""

    def __init__(self, group, rank: int, world: int, device: torch.device, run_id: str):
        self.group = group  # the process group (None: the default one)
        self.rank = rank
        self.world = world
        self.device = device  # where the flags live: the probe's device (gloo: CPU, NCCL: GPU)
        self.run_id = run_id
        self._flags = torch.zeros(world, dtype=torch.float32, device=device)
        self._mine = self._flags[rank]
        self.seen: list[int] | None = None  # ranks whose checks failed, from the last read
        self.stopped: list[int] = []  # ranks whose recorders stopped, from the last read
        self.left = False  # this rank told the others its recorder stopped (see leave)
        self.departed: list[int] = []  # ranks whose recorders detached, from the last read
        self.solo = False  # a rank detached: no collective any more (see depart)
        # attached inside an active Join: the exit's read and departure wait for its hooks
        self.in_join = False
        self.depart_pending = False

    @classmethod
    def join(cls, device: torch.device, group=None) -> Agreement | None:
        """The agreement of the default process group (or ``group``) when torch.distributed
        runs with more than one rank, else None. Waits for every rank's attach (see the
        module doc); a rank missing after the timeout is a one-line RuntimeError."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size(group)
        if world < 2:
            return None
        rank = dist.get_rank(group)
        if device.type == "meta":
            device = torch.device("cpu")
        run_id = _meet(process_group_store(group), next(_joins), rank, world)
        return cls(group, rank, world, device, run_id)

    def exchange(self, probe: torch.Tensor, stopped: bool = False) -> torch.Tensor:
        """``probe`` ([strict check, NaN-only check, 0, scale], see ``recorder.cycle``) with
        one flag per rank after it: 1 where that rank's checks failed, 2 where its recorder
        stopped (``stopped``: this rank's, see :meth:`leave`). Device ops and one all-reduce,
        no host read: the caller's read of the result is the step's one sync."""
        if self.departed and not self.solo:
            self._go_solo()
        flags = self._flags
        if flags.device != probe.device:  # the model moved since attach
            flags = self._flags = torch.zeros(self.world, dtype=torch.float32,
                                              device=probe.device)
            self._mine = flags[self.rank]
        flags.zero_()
        if stopped:
            self._mine.fill_(STOPPED)
        else:  # the strict check is 0 or NaN, the NaN-only check is NaN when a NaN counts:
            # their sum is NaN exactly when the step fails (as _read_probe decides on the host)
            self._mine.copy_(torch.isnan(probe[0] + probe[1]))
        self._all_reduce(flags)
        return torch.cat((probe, flags))

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """``all_reduce(tensor)``, its work kept (process-wide, past this recorder) until the
        next one. Gloo's worker thread otherwise may drop the last reference to the work after
        ``wait`` returned, and freeing a Python-made tensor there takes the GIL: when the main
        thread, holding it, destroys the process group meanwhile (``destroy_process_group``,
        DDP's teardown at the end of an ``mp.spawn``ed function), it joins that thread forever
        (a hang at exit, seen after every rank had trained to its end)."""
        if self.solo:  # (the tensor holds this rank's values alone: they are the sum)
            return
        work = torch.distributed.all_reduce(tensor, group=self.group, async_op=True)
        work.wait()
        _last_work[0] = work

    def read(self, values: list[float]) -> bool:
        """Keep the flags read with the probe (``values[4:]``); True when any rank failed."""
        self._keep(values[4:4 + self.world])
        return bool(self.seen)

    def _keep(self, flags: list[float]) -> None:
        self.seen = [r for r, f in enumerate(flags) if f == 1]
        self.stopped = [r for r, f in enumerate(flags) if f == STOPPED]
        self.departed = sorted({*self.departed, *(r for r, f in enumerate(flags)
                                                 if f == DEPARTED and r != self.rank)})

    def depart(self) -> None:
        """This rank's recorder detaches (its loop ended, the ``with`` block closed): said to
        the others as the flag of one more exchange, which meets their next one (the same
        point, when the ranks end together; a later step of theirs when this rank's training
        ended first: each rank trains a model of its own, or its ``with`` block closed inside
        ``Join``). Matched as a joined rank matches it (see :meth:`shadow`), slow path
        included; from then on the ranks that read it check their steps alone, instead of
        waiting at each step for a rank that no longer records (a hang until the process
        group's timeout, or a collective of the user's met in its place)."""
        if self.left or self.solo or self.departed:  # (others left first: none exchanges)
            return
        if self.in_join:  # (said by Join's hook, where the others' step meets it)
            self.depart_pending = True
            return
        self.left = True
        try:
            self._shadow(DEPARTED)
        except Exception as e:  # (logged: the recorder is detaching)
            log.warning("nanreplay: could not tell the other ranks that this rank's recorder "
                        "detached (%s: %s)", type(e).__name__, e)

    def _go_solo(self) -> None:
        self.solo = True
        log.warning("nanreplay: the recorder of rank(s) %s detached while this rank (rank %d) "
                    "records on: its steps are checked on this rank alone from here (an event "
                    "no longer stops those ranks)", ", ".join(map(str, self.departed)),
                    self.rank)

    def owes(self, health) -> bool:
        """An internal error stopped this rank's recorder (``health``) and the other ranks
        have not been told (see :meth:`leave`)."""
        return not self.left and health.internal_errors > 0 and not health.active

    def leave(self, device: torch.device) -> None:
        """This rank's recorder stopped (an error of its own) while the others record: at the
        point where its next exchange would run, it sends "stopped" instead, so that every
        rank stops at that same exchange (:meth:`stop_with_peers`) rather than wait in a
        collective this rank no longer makes (their next one would meet the model's own:
        gloo aborts, NCCL hangs, and the recorder's error would stop training). Then it never
        exchanges again."""
        self.left = True
        try:
            self.exchange(torch.zeros(4, dtype=torch.float32, device=device),
                          stopped=True).tolist()
        except Exception as e:  # (logged: there is nothing else to stop)
            log.warning("nanreplay: could not tell the other ranks that this rank's recorder "
                        "stopped (%s: %s)", type(e).__name__, e)

    def stop_with_peers(self, health) -> bool:
        """Another rank's recorder stopped after an error of its own and said so in the read
        just made: this rank's stops too (``health``), before any slow path, whose collectives
        that rank no longer makes; training goes on, unrecorded on every rank."""
        if not self.stopped:
            return False
        self.left = True  # (every rank stopped at this exchange: none makes another)
        health.active = False
        log.warning("nanreplay: the recorder of rank(s) %s stopped after an internal error; "
                    "this rank's stops with it (its per-step checks would wait for that rank); "
                    "training continues unrecorded", ", ".join(map(str, self.stopped)))
        return True

    def read_with(self, values: torch.Tensor) -> list[float]:
        """``values.tolist()`` (1-d, float, all must be finite: the update's weight norms) in
        one host read with the ranks' flags, for the reads outside the step's probe (guard
        mode's second read, the last update's at exit). Sets :attr:`seen`."""
        if self.in_join:  # (see joined.within_join: the others may still train)
            self.seen = None
            return values.float().tolist()
        probe = torch.zeros(4, dtype=torch.float32, device=values.device)
        probe[0] = values.float().mul(0).sum()  # 0, or NaN when any is not finite
        out = self.exchange(probe)
        host = torch.cat((values.float(), out[4:])).tolist()
        n = values.numel()
        self._keep(host[n:])
        return host[:n]

    def settle(self, event: Event | None, step: int, own_backward: bool = False,
               order: int | None = None, received: bool = False) -> Event | None:
        """Slow path, every rank: which ranks saw the event first, by the step (an update's
        event is its step's), then the phase, micro-batch and call each rank's own event
        names; among backward events, the ranks whose own loss sent a NaN/Inf into the
        model output (``own_backward``) first; ``order``: the event's call's place in the step's
        completion order (:func:`completion_order`); ``received``: an input event of
        activations another rank's stage sent (``recorder.received_input``), ordered after the
        forward events. Sets ``event.ranks``; a rank whose own values
        were finite gets a ``peer`` event of the first ranks' step, naming them. One more
        all-reduce, which every rank runs as every rank entered the slow path together."""
        seen = self.seen or []
        self.seen = None
        if self.rank not in seen and event is not None and event.reason == "non_finite":
            event = None  # only the others failed: what the finder made of finite values
        row = torch.zeros(self.world, 5, dtype=torch.int64, device=self.device)
        key = _order_key(event, own_backward, order, received) if event is not None \
            else (step, _LATE, 0, 0, 0)
        row[self.rank] = torch.tensor(key, dtype=torch.int64)
        self._all_reduce(row)
        keys = [tuple(k) for k in row.tolist()]
        with_event = [r for r, k in enumerate(keys) if k[1] < _LATE] or list(range(self.world))
        best = min(keys[r] for r in with_event)
        first = [r for r in with_event if keys[r] == best]
        if event is None:
            if not seen:
                return None
            event = peer_event(keys[first[0]][0], first)
        event.ranks = {"rank": self.rank, "world_size": self.world, "run_id": self.run_id,
                          "seen_by": seen, "first": first,
                          "first_phase": _PHASE_NAMES.get(best[1])}  # (what every bundle shows)
        return event

    def shadow(self) -> tuple[list[int], list[int], int | None]:
        """This rank ran out of inputs (``torch.distributed.algorithms.join.Join``) while the
        others still step: their step's exchange is matched with a flag of 0 and, when a rank
        saw a non-finite value, their slow path's all-reduce with a row of no event (see
        ``recorder.joined``). Returns the ranks that saw it, the first ones and their step."""
        if self.departed and not self.solo:  # (the ranks this one shadowed detached)
            self._go_solo()
        if self.left or self.solo:
            return [], [], None
        return self._shadow(0.0)

    def _shadow(self, flag: float) -> tuple[list[int], list[int], int | None]:
        """One exchange with this rank's ``flag`` and no probe, and the slow path's all-reduce
        with a row of no event when a rank saw a non-finite value (see :meth:`shadow`)."""
        flags = torch.zeros(self.world, dtype=torch.float32, device=self.device)
        flags[self.rank] = flag
        self._all_reduce(flags)
        self._keep(flags.tolist())
        seen, self.seen = self.seen or [], None
        if self.stopped:  # (a peer's recorder stopped: no rank exchanges again)
            self.left = True
        if not seen or self.stopped:
            return [], [], None
        row = torch.zeros(self.world, 5, dtype=torch.int64, device=self.device)
        row[self.rank, 1] = _LATE
        self._all_reduce(row)
        keys = [tuple(k) for k in row.tolist()]
        with_event = [r for r, k in enumerate(keys) if k[1] < _LATE]
        first = [r for r in with_event if keys[r] == min(keys[q] for q in with_event)]
        return seen, first, keys[first[0]][0] if first else None

    def wrote(self, ranks: dict[str, Any] | None, step: int) -> None:
        """In raise mode, once this rank's bundle of ``step`` is written (or failed, or it has
        none: a rank joined under ``Join``): say so in the store, then wait for the first
        rank(s) to say it too, and for the others a little. The launcher (torchrun's agent,
        ``mp.spawn``) ends every rank as soon as one raises: a peer raising first ended the
        first rank while it still wrote the bundle the replay needs (a large model's takes
        seconds). No device collective."""
        if not ranks or ranks.get("alone") or self.solo:
            return
        store, first = process_group_store(self.group), ranks.get("first") or []
        key = f"nanreplay/wrote/{self.run_id}/{step}/"
        store.set(f"{key}{self.rank}", "1")
        # (not for a rank whose recorder detached: it writes no bundle)
        peers = [r for r in range(self.world) if r not in self.departed]
        for waited, limit in ((first, _FIRST_WAIT_S), (peers, _PEERS_WAIT_S)):
            try:
                store.wait([f"{key}{r}" for r in waited], timedelta(seconds=limit))
            except RuntimeError:  # (a rank that never said: raise all the same)
                missing = [r for r in waited if not store.check([f"{key}{r}"])]
                log.warning("nanreplay: rank(s) %s did not say their bundle of step %d was "
                            "written within %gs; raising", missing, step, limit)

    def alone(self) -> dict[str, Any]:
        """``event.ranks`` of a step checked on this rank alone (cut short by an exception,
        no agreement): the run id lets the replay find the other ranks' bundles of the step,
        which may hold where the value began (DDP's all-reduce spreads a rank's NaN)."""
        self.seen = None
        return {"rank": self.rank, "world_size": self.world, "run_id": self.run_id,
                "seen_by": [self.rank], "first": [], "alone": True}


def _meet(store, n: int, rank: int, world: int) -> str:
    """The ``n``-th attach of every rank, met in ``store``; returns rank 0's run id."""
    keys = [f"nanreplay/attach/{n}/{r}" for r in range(world)]
    store.set(keys[rank], os.urandom(8).hex() if rank == 0 else "")
    timeout = _timeout()
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # DistStoreError: some rank has not attached
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"FlightRecorder.attach: rank(s) {missing} of {world} attached no recorder within "
            f"{timeout:g}s; under torch.distributed every rank must attach one (the ranks "
            f"agree on each step's verdict, so one rank alone would wait for the others at "
            f"every step): attach it on every rank, or set {TIMEOUT_ENV} to wait longer for "
            "ranks that attach later") from None
    return store.get(keys[0]).decode()


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        value = float(raw) if raw else _TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. "
                         "120, or unset it for the default (60)") from None
    return value if value > 0 else _TIMEOUT_S


def _order_key(event: Event, own_backward: bool = False, order: int | None = None,
               received: bool = False) -> tuple[int, int, int, int, int]:
    """(step, phase order, received, micro-batch, call) of an event: smaller saw it earlier.
    ``received`` is 1 for a backward event whose rank's output gradients were finite: its
    parameters' NaN may be another rank's, spread by the gradient all-reduce, so a rank whose
    own loss made one (``own_backward``) saw it first (every rank's event is backward then).
    ``call`` is the call's ``order`` in the step where known, else its module's call index.
    A pipeline stage's ``received`` input event counts as a forward one received: the rank
    whose module made the NaN its input holds saw it first."""
    mb = event.micro_batch
    call = order if order is not None else event.call
    phase = "forward" if received else event.phase
    received = received or event.phase == "backward" and not own_backward
    return (int(event.step), PHASE_ORDER.get(phase, _LATE - 1), int(received),
            mb if isinstance(mb, int) else 0, call if isinstance(call, int) else 0)


def completion_order(evidence, event: Event | None) -> int | None:
    """The place of ``event``'s module call among the step's calls in completion order (None
    when unknown). Under tensor parallelism a row-wise layer's all-reduce hands every rank one
    rank's NaN within the forward: the rank whose module made it finished that call before the
    others saw it come out of the enclosing module, while both are call 0 of their module."""
    if evidence is None or event is None or not isinstance(event.call, int):
        return None
    k = 0
    for d in evidence.calls:  # (decoded, in completion order)
        if evidence.module_names[d["module"]] == event.module \
                and d["micro_batch"] == event.micro_batch:
            if k == event.call:
                return d["order"]
            k += 1
    return None


def peer_event(step: int, first: list[int]) -> Event:
    """The event of a rank whose own values were finite while another rank's were not: it
    stops at the same step and writes its bundle (its shards complete the set)."""
    return Event(step, reason="peer", phase="peer",
                 detail=f"rank(s) {', '.join(map(str, first))} saw a non-finite value at step "
                        f"{step}; this rank's own values were finite")


def summary(event: dict[str, Any], path, text: str, stopped: bool = True) -> str:
    """The error's message on a rank: ``text`` (``events.summary``) with who saw the event
    first; a peer event's own words. ``stopped``: raise mode (else the warning of
    ``on_event="warn"``, after which every rank trains on)."""
    ranks = event.get("ranks")
    if not ranks:
        return text
    if event.get("phase") == "peer":
        text = f"nanreplay: {event['detail']} (step {event['step']})."
        if path is not None:
            text += f" Bundle: {path}; run `nanreplay {path}` on any rank's bundle."
    return text + describe(ranks, stopped)


def describe(ranks: dict[str, Any], stopped: bool = True) -> str:
    """The sentence the error (or warning) adds on every rank: who saw the event first."""
    if ranks.get("alone"):
        return (f" Rank {ranks['rank']} of {ranks['world_size']}; the step was cut short by an "
                "exception and checked on this rank alone: the other ranks' bundles of this "
                "step, where they wrote one, belong beside it (nanreplay replays the one that "
                "made the value).")
    first = ", ".join(map(str, ranks["first"]))
    seen = ", ".join(map(str, ranks["seen_by"]))
    # in warn mode no rank stops: saying so sent users looking for a hang that was not there
    then = ("every rank stopped at this step" if stopped else
            "every rank wrote its bundle at this step and trains on (on_event=\"warn\")")
    return (f" Rank {ranks['rank']} of {ranks['world_size']}; first seen on rank(s) {first} "
            f"(non-finite on rank(s) {seen}); {then}.")
