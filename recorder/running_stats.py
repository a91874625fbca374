"""The running statistics of normalization layers (BatchNorm's ``running_mean`` and
``running_var``), checked as each training step closes.

One record of outliers (a value of 1e20, a corrupted image) overflows its batch's variance in
float32. Train mode normalises with the batch's own statistics, so the layer's output, the loss
and the gradients stay finite, but its forward writes +inf into ``running_var``: every
evaluation from then on (``model.eval()``, the checkpoint in use) is wrong, and nothing else
says so. Training wrote that state, as an update writes weights: it is an event at that step.
The statistics are copied into one preallocated vector whose min and max go into the step's
checked slots (two device ops when the model has such layers, none otherwise; no host read of
their own); the slow path then reads the buffers themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compat import is_norm_layer
from .events import Event
from .finite import finite, kind_of
from .slots import STRICT, Slots
from .step_evidence import StepEvidence

_CHECKED = (torch.float32, torch.bfloat16, torch.float16)


class RunningStats:
    """The model's normalization layers' floating running statistics, by buffer name."""

    def __init__(self):
        self.homes: list[tuple[str, dict, str]] = []
        # name -> the buffer's copy as the step began, if any (recorder.buffers's)
        self.began: Callable[[str], torch.Tensor | None] = lambda name: None
        self._flat: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []  # flat views of the checked ones (see _make)
        self._made_for: list[torch.Tensor] = []

    def bind(self, homes: list[tuple[str, dict, str]], norm_buffers: set[str]) -> None:
        """``homes`` (name, buffer dict, key): the model's buffers; ``norm_buffers``: the
        names of those a normalization layer keeps."""
        self.homes = [h for h in homes if h[0] in norm_buffers]
        self._flat, self._made_for = None, []

    def measure(self, slots: Slots) -> None:
        """The min and max of every statistic, into two of the step's checked slots."""
        if not self.homes:
            return
        bufs = [home.get(key) for _, home, key in self.homes]
        if len(bufs) != len(self._made_for) or any(
                a is not b for a, b in zip(bufs, self._made_for)):
            self._make(bufs, slots.device)
        if self._flat is not None:
            parts = self._parts
            with torch.no_grad():
                torch.cat(parts, out=self._flat)
            slots.minmax(self._flat, STRICT)

    def _make(self, bufs: list, device: torch.device) -> None:
        """The vector for these buffers (the model's own, or new ones a ``.to()`` put there):
        float32 ones and half ones (a model trained in bfloat16 or float16 throughout keeps
        them so; ``cat`` widens them exactly) on the slots' device, flattened views (no copy
        until ``cat``). Not float64: a finite value beyond float32 would read as infinite."""
        self._made_for = bufs
        self._parts = [b.view(-1) for b in bufs if b is not None and b.dtype in _CHECKED
                       and b.numel() and b.device == device and b.is_contiguous()]
        n = sum(p.numel() for p in self._parts)
        self._flat = torch.empty(n, device=device) if n else None

    def non_finite(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of each floating statistic holding a NaN or an infinity now (read on
        the host: the slow path's)."""
        return [(n, b) for n, home, key in self.homes
                if (b := home.get(key)) is not None and b.is_floating_point()
                and not finite(b.detach())]


def statistic_event(ev: StepEvidence, running: RunningStats) -> Event | None:
    """A forward event at the normalization layer whose running statistic the step left
    non-finite, when nothing else in the step was (its first call: the replay finds which)."""
    bad = running.non_finite()
    if not bad:
        return None
    name, b = bad[0]
    module, kind = name.rpartition(".")[0], statistic_kind(b)
    began = running.began(name)
    came = began is not None and not finite(began)  # (loaded so, or before the attach)
    idx = ev.module_names.index(module) if module in ev.module_names else None
    d = next((d for d in ev.calls if d["module"] == idx), None) if idx is not None else None
    more = f" (and {', '.join(n for n, _ in bad[1:])})" if len(bad) > 1 else ""
    return Event(ev.tape.step, phase="forward", module=module, call=0,
                 module_type=ev.module_types[idx] if idx is not None else None,
                 micro_batch=d["micro_batch"] if d is not None else 0,
                 kind=kind, statistic=name, inputs_finite=not came, detail=(
                     f"running statistic {name}{more} already held {kind} as the step began "
                     "(written before the recorder attached, or loaded so)" if came else
                     f"running statistic {name}{more} holds {kind} after the step's forward, "
                     "whose outputs, loss and gradients were finite (train mode normalises "
                     "with the batch's own statistics; evaluation uses this one)"))


def statistic_kind(b: torch.Tensor) -> str:
    """What the buffer holds: ``nan``, ``+inf`` or ``-inf``."""
    return kind_of(b.detach()) or "nan"


def named_running_statistics(module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of a normalization layer's own floating buffers (its running
    statistics); none for any other module."""
    if not is_norm_layer(module):
        return []
    return [(n, b) for n, b in module.named_buffers(recurse=False)
            if b.is_floating_point() and b.numel()]


def running_statistics(module) -> list[torch.Tensor]:
    """A normalization layer's own running statistics (:func:`named_running_statistics`)."""
    return [b for _, b in named_running_statistics(module)]


def statistics_finite(module) -> bool | None:
    """None for a module keeping no running statistics; else whether they are all finite."""
    stats = running_statistics(module)
    return all(finite(b.detach()) for b in stats) if stats else None


def statistics_kind(module) -> str | None:
    """What the first non-finite running statistic of ``module`` holds, None if none."""
    return next((k for b in running_statistics(module) if (k := kind_of(b.detach()))), None)
