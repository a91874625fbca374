"""The rewind window (``FlightRecorder(..., rewind=N)``): copies of the training state every N
steps and a log of every step since the older copy, so the steps that led to an event can be
re-run (``nanreplay`` re-runs them from the copy, see ``replay.window``).

A **copy** is taken when step ``s`` opens (before its forward, after the last update and the
scheduler's step): the weights, buffers, optimizer state and hyper-parameters, the scheduler's
``state_dict()`` and the GradScaler's scale. Two are kept: the one being replaced is the older
of the two, so the previous copy stays until the next is complete and the window always spans
N to 2N steps. On a CUDA device the copies go into pinned host memory with ``non_blocking``
copies (off the critical path, no sync); elsewhere they are plain clones. Buffers of the copy
being replaced are reused when their shapes still fit.

The **log** holds, per step since the older copy, what re-running it needs and the copy does
not: the micro-batches (cloned when the step closes, as the bundle stores the event step's),
the RNG states the recorder captured when the step opened, the hyper-parameters of each
parameter group the update used (the learning rate a scheduler set: recorded, not re-derived),
and the GradScaler's scale that the step's one host read returned. Nothing here reads the
device or draws a random number.

Bundle keys (``docs/bundle-format.md``): ``rewind/weights/<param>``, ``rewind/buffers/<buffer>``,
``rewind/optim/<param>/<key>``, ``rewind/optim_group/<g>/<key>``, ``rewind/sched/<n>``,
``rewind/scaler/<name>``, ``rewind/step/<s>/...`` (batch, loss inputs, output gradients, RNG of
step ``s``) and ``meta.rewind``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from .abandoned import marked
from .capture import flatten_tree, map_tensors, tensor_leaves
from .compat import scaler_tensors
from .entries import hyper_entry, jsonish, micro_batch_entry, named_params
from .inner_optim import state_items
from .rng import rng_to_bundle
from .seq_state import is_seq, store_seq

log = logging.getLogger("nanreplay")


@dataclass
class _Copy:
    step: int
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)  # param -> state
    hyper: list[dict[str, Any]] = field(default_factory=list)  # per group, without params
    scheduler: Any = None  # state_dict() with tensors cloned
    scaler: dict[str, Any] | None = None
    done: Any = None  # a CUDA event after the non_blocking copies, else None

    def tensors(self):
        yield from self.weights.values()
        yield from self.buffers.values()
        for st in self.optim.values():
            for v in st.values():  # (a tuple of tensors too: see _state_copy)
                yield from ([v] if isinstance(v, torch.Tensor) else
                            [x for x in v if x is not None] if is_seq(v) else ())
        for h in self.hyper:
            yield from (v for v in h.values() if isinstance(v, torch.Tensor))
        yield from tensor_leaves(self.scheduler)
        if self.scaler:
            yield from (v for v in self.scaler.values() if isinstance(v, torch.Tensor))


@dataclass
class _Record:
    step: int
    rng: dict[str, Any]
    micro_batches: list[dict[str, Any]]  # bundle micro-batch entries, keys under rewind/step/
    tensors: dict[str, torch.Tensor]
    hyper: list[dict[str, Any]]
    scale: float | None
    skipped: bool
    frozen: list[str] = field(default_factory=list)  # parameters with requires_grad False
    frozen_grads: list[str] = field(default_factory=list)  # of those, holding a .grad tensor
    attrs: list | None = None  # the modules' plain attributes as it began (AttributeWatch)


class Rewind:
    """The copies and the per-step log; the step cycle (:mod:`recorder.cycle`) owns it and
    calls :meth:`opened` when a training step opens and :meth:`closed` when it closed (after
    its one host read)."""

    def __init__(self, every: int):
        self.every = every
        self._first: int | None = None
        self._copies: list[_Copy] = []  # oldest first, at most two
        self._log: list[_Record] = []
        self.modules = None  # Target.module_ids, set by the recorder (see micro_batch_entry)
        self.watch = None  # () -> Target.attributes, set by the recorder (see closed)

    # -- what the step cycle calls -----------------------------------------------------------

    def opened(self, step: int, params, buffers, optimizer, scheduler, scaler) -> None:
        if self._first is None:
            self._first = step
        if (step - self._first) % self.every:
            return
        reuse = self._copies.pop(0) if len(self._copies) == 2 else None
        self._copies.append(_take_copy(step, params, buffers, optimizer, scheduler, scaler,
                                       reuse))
        oldest = self._copies[0].step
        self._log = [r for r in self._log if r.step >= oldest]

    def closed(self, tape, optimizer, scale: float | None, skipped: bool, params) -> None:
        if not self._copies or tape.step < self._copies[0].step:
            return
        prefix = f"rewind/step/{tape.step}/"
        tensors: dict[str, torch.Tensor] = {}
        mbs = marked(tape, [micro_batch_entry(prefix, i, mb, tensors, tape.micro_batches[:i],
                                              self.modules, named_params(params))
                            for i, mb in enumerate(tape.micro_batches)])
        for k in list(tensors):
            tensors[k] = _to_host(tensors[k])
        hyper = _hyper(optimizer) if optimizer is not None else []
        # the frozen parameters (requires_grad_(False), unfrozen later in the window): the
        # re-run, whose rebuilt model trains every one, leaves them as training did
        frozen = [n for n, p in params if not p.requires_grad]
        # of those, the ones still holding a gradient tensor (the zeros that
        # zero_grad(set_to_none=False) leaves): the optimizer still updates them (Adam's
        # momentum, a decoupled decay), so the re-run must not drop them
        frozen_grads = [n for n, p in params if not p.requires_grad and p.grad is not None]
        # the loop's schedule of module attributes (a dropout p raised, a temperature
        # annealed): each step re-runs with its own, not the event step's (a reference to
        # the values the step's open took; compared with attach only at export)
        attrs = self.watch().started if self.watch is not None else None
        self._log.append(_Record(tape.step, tape.rng, mbs, tensors, hyper, scale, skipped,
                                 frozen, frozen_grads, attrs))

    def clear(self) -> None:
        self._copies, self._log, self._first = [], [], None

    # -- reporting ---------------------------------------------------------------------------

    def log_attached(self, params, buffers, optimizer) -> None:
        """Say at attach what the copies will hold (memory is bounded and reported)."""
        log.info("nanreplay: rewind=%d keeps two copies of the training state (%d bytes each "
                 "now, in host memory; 0 bytes on the device) and each step's batch since the "
                 "older copy; memory_bytes reports them", self.every,
                 self.copy_bytes(params, buffers, optimizer))

    def nbytes(self) -> dict[str, int]:
        """Bytes held now: host (copies and log) and device (none: on CUDA everything goes to
        pinned host memory; on CPU everything is host memory)."""
        host = sum(_size(t) for c in self._copies for t in c.tensors())
        host += sum(_size(t) for r in self._log for t in r.tensors.values())
        return {"rewind_host": host, "rewind_device": 0}

    @staticmethod
    def copy_bytes(params, buffers, optimizer) -> int:
        """Bytes of one copy of the state as it is now (optimizer state that an optimizer
        creates at its first step, Adam's moments, is not there yet at attach)."""
        n = sum(_size(p) for _, p in params) + sum(_size(b) for _, b in buffers)
        if optimizer is not None:
            n += sum(_size(v) for _, st in state_items(optimizer) for v in st.values()
                     if isinstance(v, torch.Tensor))
        return n

    def export(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``meta.rewind`` for the bundle; the tensors go into ``tensors``."""
        if not self._copies:
            return {}
        copy = self._copies[0]
        if copy.done is not None:
            copy.done.synchronize()  # the non_blocking copies have landed (the bundle's write)
        for n, t in copy.weights.items():
            tensors[f"rewind/weights/{n}"] = t
        for n, t in copy.buffers.items():
            tensors[f"rewind/buffers/{n}"] = t
        scalars: dict[str, dict[str, Any]] = {}
        for n, st in copy.optim.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"rewind/optim/{n}/{k}"] = v
                elif store_seq(n, k, v, tensors, scalars, prefix="rewind/optim_seq/"):
                    pass  # (a low-bit optimizer's (codes, scales): see recorder.seq_state)
                elif jsonish(v):
                    scalars.setdefault(n, {})[k] = v
        meta: dict[str, Any] = {
            "every": self.every, "copy_step": copy.step,
            "steps": [r.step for r in self._log],
            "optimizer": {"param_groups": [hyper_entry(h, f"rewind/optim_group/{g}", tensors)
                                           for g, h in enumerate(copy.hyper)],
                          "state_scalars": scalars},
            "lr_scheduler": None, "grad_scaler": None, "records": [],
        }
        if copy.scheduler is not None:
            tree, ts, _ = flatten_tree(copy.scheduler, "rewind/sched")
            tensors.update(ts)
            meta["lr_scheduler"] = tree
        if copy.scaler is not None:
            meta["grad_scaler"] = {}
            for k, v in copy.scaler.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"rewind/scaler/{k}"] = v
                    meta["grad_scaler"][k] = {"$t": f"rewind/scaler/{k}"}
                else:
                    meta["grad_scaler"][k] = v
        for r in self._log:
            rng_meta, rng_tensors = rng_to_bundle(r.rng)
            prefix = f"rewind/step/{r.step}/"
            tensors.update({prefix + k: v for k, v in rng_tensors.items()})
            tensors.update(r.tensors)
            meta["records"].append({
                "step": r.step, "rng": rng_meta, "micro_batches": r.micro_batches,
                "hyper": [hyper_entry(h, f"{prefix}optim_group/{g}", tensors)
                          for g, h in enumerate(r.hyper)],
                "scale": r.scale, "skipped": r.skipped, "frozen": r.frozen,
                **({"frozen_grads": r.frozen_grads} if r.frozen_grads else {}),
                "attrs": self.watch().differences(r.attrs) if self.watch is not None else {}})
        meta["memory_bytes"] = self.nbytes()
        return meta


# ---------------------------------------------------------------------------------------------
# copies


def _to_host(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of ``t``: on CUDA a ``non_blocking`` copy into pinned memory (no sync; it
    lands before the stream's next host read), else a clone. ``into`` is reused when it fits."""
    t = t.detach()
    if into is not None and into.shape == t.shape and into.dtype == t.dtype \
            and (t.device.type != "cuda" or into.is_pinned()):
        return into.copy_(t, non_blocking=t.device.type == "cuda")
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.clone()


def _take_copy(step, params, buffers, optimizer, scheduler, scaler, reuse: _Copy | None) -> _Copy:
    old = reuse or _Copy(step)
    copy = _Copy(step)
    cuda = False
    with torch.no_grad():
        for n, p in params:
            copy.weights[n] = _to_host(p, old.weights.get(n))
            cuda |= p.device.type == "cuda"
        for n, b in buffers:
            copy.buffers[n] = _to_host(b, old.buffers.get(n))
        if optimizer is not None:
            names = {id(p): n for n, p in params}
            for p, st in state_items(optimizer):
                n = names.get(id(p))
                if n is None:
                    continue
                was = old.optim.get(n, {})
                copy.optim[n] = {k: _state_copy(v, was.get(k)) for k, v in st.items()}
            copy.hyper = _hyper(optimizer)
        if scheduler is not None:
            copy.scheduler = map_tensors(scheduler.state_dict(), _to_host)
        if scaler is not None:
            copy.scaler = _scaler_state(scaler)
    if cuda:
        copy.done = torch.cuda.Event()
        copy.done.record()
    return copy


def _state_copy(v: Any, was: Any) -> Any:
    """A host copy of one optimizer state value: a tensor, or a tuple or list of tensors (a
    low-bit optimizer's (codes, scales), written in place by its updates: kept as it was, the
    copy was the live state, and the bundle left it out), else ``v`` itself."""
    if isinstance(v, torch.Tensor):
        return _to_host(v, was if isinstance(was, torch.Tensor) else None)
    if not is_seq(v):
        return v
    olds = list(was) if is_seq(was) and len(was) == len(v) else [None] * len(v)
    return type(v)(None if x is None else _to_host(x, o if isinstance(o, torch.Tensor) else None)
                   for x, o in zip(v, olds))


def _hyper(optimizer) -> list[dict[str, Any]]:
    """Each group's hyper-parameters as the update will use them (tensor values copied)."""
    return [{k: (_to_host(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items()
             if k != "params"} for g in optimizer.param_groups]


def _scaler_state(scaler) -> dict[str, Any]:
    """The GradScaler's settings and its scale and growth tracker as host tensors (its
    ``state_dict()`` reads them with ``.item()``, a sync; :func:`compat.scaler_tensors`)."""
    state: dict[str, Any] = {"growth_factor": scaler.get_growth_factor(),
                             "backoff_factor": scaler.get_backoff_factor(),
                             "growth_interval": scaler.get_growth_interval(),
                             "enabled": scaler.is_enabled()}
    for name, t in scaler_tensors(scaler).items():
        state[name] = _to_host(t)
    return state


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rename_window(meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                  renamed: dict[str, str]) -> None:
    """The window's copies under the parameters' names now (:meth:`Target.rename`): a copy
    taken under ``fc.weight`` before ``torch.nn.utils.prune`` re-registered it as
    ``fc.weight_orig`` is that parameter's (by its old name the replay found no copy of the
    pruned weight and re-ran the window from the bundle's, the event's, values)."""
    window = meta.get("rewind")
    if not window or not renamed:
        return
    for kind in ("weights", "optim"):
        head = f"rewind/{kind}/"
        for key in [k for k in tensors if k.startswith(head)]:
            name, sep, rest = key[len(head):].partition("/") if kind == "optim" \
                else (key[len(head):], "", "")
            if name in renamed:
                tensors[f"{head}{renamed[name]}{sep}{rest}"] = tensors.pop(key)
    scalars = window.get("optimizer", {}).get("state_scalars", {})
    window.get("optimizer", {})["state_scalars"] = {renamed.get(n, n): v
                                                    for n, v in scalars.items()}
    for record in window.get("records", []):
        for key in ("frozen", "frozen_grads"):
            record[key] = [renamed.get(n, n) for n in record.get(key, [])]
