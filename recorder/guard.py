"""The optimizer's side of a step: its pre-hook closes the step before the update, its
post-hook takes evidence of what the update wrote.

By default that evidence is the squared norm of every weight the optimizer holds, computed on
the device and read with the next step's one host read (see :mod:`recorder.cycle`).
``guard_optimizer=True`` instead copies the weights, gradients and optimizer state before each
update and checks the weights right after it (a second sync), so a bundle can re-run the update
that made weights non-finite.
"""

from __future__ import annotations

import logging
import math
import threading
from functools import partial
from typing import Any

import torch

from .alarm import Alarm
from .compat import foreach_norm
from .compiled import disabled
from .cycle import StepCycle, UpdateEvidence
from .errors import NonFiniteError
from .grads import reread_changed_grads
from .hooks import Health, Hook
from .inner_optim import full_state
from .seq_state import cloned
from .shards import local
from .slots import _WIDE, STRICT, FlatViews, Slots
from .tape import Tape
from .target import Target
from .traced_backward import say_backward_wrote_nothing
from .unheld_params import say_unheld
from .unwatched_loss import LossWatch

log = logging.getLogger("nanreplay")


class OptimizerGuard:
    """The optimizer hooks of one recorder."""

    def __init__(self, target: Target, cycle: StepCycle, health: Health, alarm: Alarm):
        self.target, self.cycle, self.health, self.alarm = target, cycle, health, alarm
        self.settings = target.settings
        self.copies: dict[str, Any] | None = None  # guard mode: the state before the update
        self.last_tape: Tape | None = None  # guard mode: the step those copies belong to
        # where the updates' evidence is computed, two in turn: an update's evidence stays
        # intact while the next update (another thread's step()) computes its own; the lock
        # keeps two threads' post-hooks from taking the same one
        self._slots: list[Slots | None] = [None, None]
        self._lock = threading.Lock()
        # flat views of the large and of the small weights, kept between steps: "large" or
        # "small" -> (the target's list they view, its indices, the views)
        self._views: dict[str, tuple[list, list[int], FlatViews]] = {}
        self._transform_warned = False
        self._update_only_said = False
        self._forward_steps = False  # a step opened by a forward of the model has closed
        # says once whether the first training step's loss went unwatched (set by the recorder)
        self.loss_watch: LossWatch | None = None

    def register(self, optimizer) -> list:
        # (run eagerly where dynamo traces ``optimizer.step()``, a compiled training step:
        # traced, the step's host read and the bundle's writing would run once, at tracing)
        return [optimizer.register_step_pre_hook(Hook(disabled(self.pre_hook))),
                optimizer.register_step_post_hook(Hook(disabled(self.post_hook)))]

    def release(self) -> None:
        self.copies = self.last_tape = None
        self._slots = [None, None]
        self._views = {}

    @property
    def nbytes(self) -> int:
        if not self.copies:
            return 0
        return sum(t.numel() * t.element_size() for t in self.copies["tensors"])

    def pre_hook(self, optimizer, args, kwargs):
        if not self.health.active:  # (but a stopped rank may still owe the others a word)
            ranks = self.target.ranks
            if ranks is None or not ranks.owes(self.health):
                return None
        self.cycle.foreign.stepping = True  # its updates are no other optimizer's (LBFGS)
        # (``args`` holds the optimizer itself first: the hook wraps the unbound step)
        closure = kwargs.get("closure") if "closure" in kwargs else (
            args[1] if len(args) > 1 else None)
        if callable(closure):
            # step(closure): the step's forward and backward run inside step(), in the closure
            # (Lightning's automatic optimization, LBFGS): close the step when it returns,
            # still before the update
            wrapped = partial(self.after_closure, optimizer, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self.before_update(optimizer)
        return None

    def after_closure(self, optimizer, closure, *args, **kwargs):
        # LBFGS evaluates the closure again after each of its inner updates: each evaluation
        # ran on other weights than the one before, so each is a step of its own, closed
        # before the next inner update (joined to one step, the bundle's weights were the
        # last evaluation's, and the replay of the earlier ones blamed the factory)
        result = closure(*args, **kwargs)
        self.before_update(optimizer)
        return result

    def before_update(self, optimizer) -> None:
        """Close the step right before ``optimizer`` updates the weights."""
        cycle = self.cycle
        tape = cycle.tape  # another thread may close it meanwhile: work on this one
        if not self.health.active:
            cycle.leave_ranks()  # (a step's close: where this rank's exchange would run)
            return
        transformed, cycle.transformed = cycle.transformed, False
        if tape is None and cycle.unrooted_call is None \
                and not self._forward_steps and self._grads_written():
            # (forwards under torch.func transforms only, DP-SGD's vmap(grad(...)): a step of
            # its own as well, so that the gradients the loop wrote are checked before the update)
            if transformed:
                self._only_transformed(checked=True)
            if (tape := self._update_only()) is not None:
                tape.transformed = transformed
        elif tape is not None and tape.micro_batches:
            # (a loop that steps after its forwards: a second step() with none since, a
            # thread's racing the first, updates with the gradients that step checked)
            self._forward_steps = True
        cycle.updated = cycle.ever_updated = True  # the next step's weights come from it
        cycle.eval_tail = None
        if tape is None:
            if cycle.unrooted_call is not None:
                cycle.unrooted()
            elif transformed:
                self._only_transformed(checked=False)
            return
        try:  # (small parameters: when the row is built)
            reread_changed_grads(tape, self.target, self.settings.param_norms)
        except Exception as e:
            self.health.internal_error(e)
        cycle.close_tape(at="optimizer")
        if (watch := self.loss_watch) is not None and watch.armed and tape.micro_batches \
                and not tape.evaluation:
            watch.step_closed(tape)  # (the first training step: said once)
            if not say_backward_wrote_nothing(optimizer):  # (else no gradient says anything)
                say_unheld(self.target.model(), optimizer, self.target.loss_module())
        if self.settings.guard_optimizer and not self.alarm.fired:
            self.copies = _copy_for_guard(optimizer, self.target.params)
            self.last_tape = tape
            cycle.update_guard = self  # (read only if the update raises: update_linalg)

    def _grads_written(self) -> bool:
        """Some parameter holds a gradient: the loop wrote one (an update without any, as the
        ``optimizer.step()`` that silences the scheduler's order warning before training,
        changes no weight and is no step)."""
        return any(p.grad is not None for _, p in self.target.params)

    def _update_only(self) -> Tape | None:
        """A step of its own for an update in a loop that runs no forward of the recorded
        model: it writes the gradients itself, from a copy of the model it trained (Reptile's
        ``p.grad = p - fast_p``, evolution strategies). Unchecked, NaN gradients there made NaN
        weights, found only at a later read and named as an update of step -1; as a step, its
        gradients are checked before the update, which then belongs to it."""
        cycle = self.cycle
        with cycle.lock:  # (a training step's tape: as a forward opens one)
            tape = cycle.tape if cycle.tape is not None else cycle.tape_for_forward(False)
        if not self._update_only_said and cycle.traced:
            self._update_only_said = True
            # (dynamo traced the submodules' hooks into a graph no call of the model ran)
            log.warning("nanreplay: optimizer.step() ran with no call of the recorded model "
                        "since the last step while its layers' hooks ran inside a torch.compile "
                        "graph: the loop calls a compiled forward itself (fwd = "
                        "torch.compile(model.forward); fwd(x)), which skips model(...) and its "
                        "hooks, so no forward is recorded and nanreplay cannot re-run one. "
                        "Compile the model instead (torch.compile(model) or model.compile()) "
                        "and call it")
        elif not self._update_only_said:
            self._update_only_said = True
            # (a loop that trains a copy: Reptile's deepcopy, a functional copy without the
            # recorder's hooks; its forwards are not recorded, which the user should know)
            log.warning("nanreplay: optimizer.step() ran with no forward of the recorded model "
                        "with gradients on since the last step (a copy of it ran instead, as "
                        "Reptile's fast weights; it ran under torch.no_grad() only, as an "
                        "evolution strategy's evaluations; or the loop wrote the gradients "
                        "itself): each such update is a step of its own, its gradients and "
                        "update checked, but no forward is recorded, so nanreplay cannot re-run "
                        "one")
        return tape

    def _only_transformed(self, checked: bool) -> None:
        """An update whose step ran the model only under torch.func transforms: said once
        (instead of :meth:`_update_only`'s warning, where the update is still ``checked``)."""
        self._update_only_said = self._update_only_said or checked
        if self._transform_warned:
            return
        self._transform_warned = True
        log.warning("nanreplay: optimizer.step() ran after forwards of the recorded model under "
                    "torch.func transforms (vmap, grad, jvp) only: those are not recorded, so "
                    "%s; call the model once outside them in each step (the forward of the loss "
                    "you log)", "only its gradients and the update are checked, "
                    "and nanreplay cannot re-run its forward" if checked else
                    "nothing of this step was checked")

    def post_hook(self, optimizer, args, kwargs):
        """Evidence of what the update wrote: the squared norm of every weight the optimizer
        holds, on the device, read with the next step's host read. Guard mode checks them now
        instead (the mode's second sync)."""
        self.cycle.foreign.stepped(self.cycle.tape, self.target.watched)
        if not self.health.active:
            return None
        if self.alarm.state_check and not self.alarm.fired:  # (rare: see state_check)
            try:
                self.alarm.state_event(optimizer, self.cycle.step - 1)
            except NonFiniteError:
                raise
            except Exception as e:
                self.health.internal_error(e)
        if not self.settings.guard_optimizer:
            try:
                self._measure_update()
            except Exception as e:
                self.health.internal_error(e)
            return None
        if self.copies is not None and not self.alarm.fired:
            params = self.target.params
            norms, ranks = _norms(list(enumerate(p for _, p in params))), self.target.ranks
            stacked = torch.stack([n for _, n in norms])
            # guard mode's 2nd sync (with the ranks' flags: every rank stops if one must)
            values = ranks.read_with(stacked) if ranks is not None else stacked.tolist()
            if self.cycle.peers_stopped():
                return None
            bad = [params[i][0] for (i, _), v in zip(norms, values) if not math.isfinite(v)]
            if bad or (ranks is not None and ranks.seen):
                self.alarm.optimizer_event(bad, step=self.cycle.step - 1, after_update=False,
                                           tape=self.last_tape, guard=self.copies)
            else:
                self.cycle.updated = False  # verified: weights bad later were not its doing
        return None

    def _measure_update(self) -> None:
        """Squared norms of the weights right after an update into slots of their own (one dot
        per large weight, one foreach call for many small ones); no host read."""
        large, small = self.target.update_large, self.target.update_small
        if not large and not small:
            return
        device = (large or small)[0][1].device
        with self._lock:
            self._slots.reverse()
            slots = self._slots[0]
            if slots is None or slots.device != device:
                n = len(large) + len(small) + 8  # (only STRICT slots: its row piece)
                slots = self._slots[0] = Slots(device, sizes=(n, 0, 0, 0))
            slots.start_step()
            refs = self._large_norms(slots, large, device)
            if small:
                refs += self._small_norms(slots, small, device)
            # the update belongs to the step the pre-hook just closed
            self.cycle.pending_update = UpdateEvidence(self.cycle.step - 1, refs, slots)

    def _views_of(self, kind: str, indexed: list) -> tuple[list[int], FlatViews]:
        """The indices of ``indexed`` (the target's ``update_large`` or ``update_small``) and
        flat views of its weights, made again when the target partitions anew."""
        held = self._views.get(kind)
        if held is None or held[0] is not indexed:
            held = self._views[kind] = (indexed, [i for i, _ in indexed],
                                        FlatViews([p for _, p in indexed]))
        return held[1], held[2]

    def _small_norms(self, slots: Slots, small: list, device: torch.device):
        """(index, ref) of the small weights' squared norms: one foreach call, over views kept
        from step to step where every weight has one (no detach per weight per step)."""
        idx, views = self._views_of("small", small)
        flats = views.get(device)
        return zip(idx, slots.sq_norms(
            flats if views.every else [local(p).detach() for _, p in small], STRICT))

    def _large_norms(self, slots: Slots, large: list, device: torch.device) -> list:
        """(index, ref) of each large weight's squared norm: one dot over a view kept from
        step to step (see :class:`~recorder.slots.FlatViews`) where it can be."""
        idx, views = self._views_of("large", large)
        flats = views.get(device)
        if views.every:  # (the usual case)
            return list(zip(idx, slots.sq_norm_flat(flats, STRICT)))
        # (detached, so no ``no_grad`` context is needed)
        return [(i, slots.sq_norm_flat([f], STRICT)[0] if f is not None
                 else slots.sq_norm(local(p).detach(), STRICT))
                for (i, p), f in zip(large, flats)]


def _norms(indexed_params) -> list[tuple[int, torch.Tensor]]:
    idx, tensors = [], []
    for i, t in indexed_params:
        if t is None or t.layout != torch.strided or t.numel() == 0:
            continue
        idx.append(i)
        tensors.append(local(t).detach())  # (a DTensor: its local shard)
    if not tensors:
        return []
    with torch.no_grad():
        wide = [t.dtype in _WIDE for t in tensors]
        if not any(wide):
            return list(zip(idx, foreach_norm(tensors, torch.float32)))
        # a float32 norm refuses float64 and complex weights (a float64 Poincare embedding):
        # those in their own precision, the rest in float32 (a float16 norm overflows); all
        # as float64, which the caller stacks
        norms = iter(foreach_norm([t for t, w in zip(tensors, wide) if w], None))
        narrow = iter(foreach_norm([t for t, w in zip(tensors, wide) if not w], torch.float32)
                      if not all(wide) else [])
        return [(i, (next(norms) if w else next(narrow)).double())
                for i, w in zip(idx, wide)]


def _copy_for_guard(optimizer, params) -> dict[str, Any]:
    names = {id(p): n for n, p in params}
    copies: dict[str, Any] = {"weights": {}, "grads": {}, "state": {}, "tensors": []}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                n = names.get(id(p))
                if n is None:
                    continue
                copies["weights"][n] = p.detach().clone()
                if p.grad is not None:
                    copies["grads"][n] = p.grad.detach().clone()
                st = full_state(optimizer, p)
                copies["state"][n] = {k: cloned(v) for k, v in st.items()}
    for d in (copies["weights"], copies["grads"]):
        copies["tensors"].extend(d.values())
    for st in copies["state"].values():
        copies["tensors"].extend(v for v in st.values() if isinstance(v, torch.Tensor))
    copies["hyper"] = [{k: v for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]
    return copies
