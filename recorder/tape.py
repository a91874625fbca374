"""One step's record: device-side statistics per module call, and references to the batch.

Statistics are 0-d device tensors appended to one of three lists, which become one row at the
end of the step:

- ``STRICT``: must be finite (outputs, root inputs, loss, gradient and parameter norms);
- ``NAN_ONLY``: must not be NaN (outputs of modules allowed to hold +-Inf);
- ``LOOSE``: kept, never checked (means, spreads, inputs of inner calls).

A reference to an entry is ``(list, index)``; :meth:`Tape.resolve` turns it into an index of the
final row once the list lengths are known.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .slots import Slots

STRICT, NAN_ONLY, LOOSE = 0, 1, 2


@dataclass
class MicroBatch:
    """One root-module call of the step, kept by reference."""

    args: tuple
    kwargs: dict
    grad_enabled: bool = True
    autocast: dict[str, str] = field(default_factory=dict)  # device type -> dtype
    outputs: Any = None
    loss_args: tuple | None = None
    loss_kwargs: dict | None = None
    out_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    input_refs: tuple = ()


class Tape:
    """Everything recorded during one step (all micro-batches)."""

    def __init__(self, step: int, rng: dict[str, Any], scaler_token: int | None, slots: Slots):
        self.step = step
        self.slots = slots  # where this step's statistics are computed
        self.rng = rng
        self.scaler_token = scaler_token
        self.parts: tuple[list, list, list] = ([], [], [])
        self.device: torch.device | None = None
        # (module index, micro-batch, completion order, outs, stats, ins)
        self.calls: list[tuple] = []
        self.micro_batches: list[MicroBatch] = []
        self.loss: list[tuple[int, tuple, tuple]] = []
        # id(tensor) -> (weakref, min ref, max ref, allowed): outputs seen this step,
        # so a module whose input is an earlier output costs no extra reduction.
        self.cache: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.copied_buffers: set[str] = set()  # buffers whose pre-step value is in the copies
        self.params_from_update = False  # an optimizer step ran since the previous step
        # per-parameter norms taken as backward wrote each gradient (see FlightRecorder)
        self.grad_norms: dict[int, torch.Tensor] = {}
        self.param_norms: dict[int, torch.Tensor] = {}
        self.grad_seen: dict[int, tuple[int, int]] = {}  # (id, version) of the gradient read
        self.grads_reread = False  # norms re-read before the update (not as backward wrote)

    def add(self, code: int, t: torch.Tensor) -> tuple[int, int]:
        if self.device is None:
            self.device = t.device
        elif t.device != self.device:  # model spread over devices: gather on the first
            t = t.to(self.device, non_blocking=True)
        lst = self.parts[code]
        lst.append(t)
        return code, len(lst) - 1

    def offsets(self) -> tuple[int, int, int]:
        s, n, _ = (len(p) for p in self.parts)
        return 0, s, s + n

    @staticmethod
    def resolve(ref: tuple[int, int], offsets: tuple[int, int, int]) -> int:
        return offsets[ref[0]] + ref[1]

    @property
    def micro_batch(self) -> int:
        return len(self.micro_batches) - 1
