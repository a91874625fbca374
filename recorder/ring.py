"""The ring buffer: the last ``history`` steps of statistics, kept on the model's device.

Each step copies the statistics its hooks wrote into :mod:`recorder.slots` into the next row (a
flat float32 vector: :meth:`RingBuffer.reserve`, then :meth:`RingBuffer.commit`) and keeps a
small host-side :class:`StepLayout` saying which entry of the row is what. Rows stay on the
device; they are decoded into a fixed table only when a bundle is written, so recording costs
one device op per step and no host transfer.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .finite import pair_ok
from .slots import RELU_OF

CALL_FIELDS = ("min", "max", "absmax", "mean", "rms", "nan", "posinf", "neginf", "inputs_finite")


@dataclass(slots=True)
class StepLayout:
    """Where each statistic of one step lives in that step's row (all indices into the row).
    The entry lists are empty tuples until :meth:`materialize` makes them (none per step)."""

    step: int
    lrs: list[float | torch.Tensor]  # (a device tensor lr: its copy, read at export)
    skipped: bool = False
    grads_scaled: bool = False  # gradient norms are of GradScaler-scaled gradients
    scale: float | None = None
    # (module index, micro-batch, completion order, ((min, max), ...) per output tensor,
    #  (sum, 2-norm, numel) | None,
    #  ((min, max, from_allowed), ...) per input tensor)
    calls: Sequence[tuple] = ()
    loss: Sequence[tuple[int, int, int]] = ()  # (micro-batch, min, max)
    grads: Sequence[tuple[int, int]] = ()  # (param index, norm)
    params: Sequence[tuple[int, int]] = ()  # (param index, norm)
    # (param index, squared norm) of the weights right after the previous step's update, the
    # update of step ``update_step`` (None: no update since the previous step)
    updates: Sequence[tuple[int, int]] = ()
    update_step: int | None = None
    # (micro-batch, output index, squared norm) of the gradient backward brought to each
    # root output
    out_grads: Sequence[tuple[int, int, int]] = ()
    length: int = 0
    # (tape calls, loss, grad refs, param refs, (update entries first, region starts, region
    #  ends), update refs, output-gradient refs): slot refs, resolved into the fields above by
    #  materialize() when decoded
    raw: tuple | None = None

    def materialize(self) -> StepLayout:
        if self.raw is None:
            return self
        calls, loss, grads, params, (shift, starts, ends), updates, out_grads = self.raw
        self.raw = None
        self.updates = [(i, ref[1]) for i, ref in updates]  # (the row's first entries)
        # where each region's entries end: in a row gathered region by region (a step that ran
        # short), a slot another thread's hook took after the gather holds no value of this
        # step, so what refers to it is left out (a whole-vector row has every slot a ref in
        # the layout names: that ref was recorded after its value was written, before the copy)

        def r(ref):
            code, k = ref
            if code >= RELU_OF:  # the ReLU of a slot: ~index (see decoded)
                return ~r((code - RELU_OF, k))
            k += starts[code]
            if k >= ends[code]:
                raise _Late
            return shift + k

        self.calls = []
        for m, mb, st, outs, stats, ins in calls:
            try:
                self.calls.append((m, mb, st, tuple((r(a), r(b)) for a, b in outs),
                                   None if stats is None else (r(stats[0]), r(stats[1]), stats[2]),
                                   tuple((r(a), r(b), al) for a, b, al in ins)))
            except _Late:
                pass
        self.loss = _resolved(loss, lambda e: (e[0], r(e[1]), r(e[2])))
        self.grads = _resolved(grads, lambda e: (e[0], r(e[1])))
        self.params = _resolved(params, lambda e: (e[0], r(e[1])))
        self.out_grads = _resolved(out_grads, lambda e: (e[0], e[1], r(e[2])))
        return self


class _Late(Exception):
    """A ref to a slot taken after its step's row was gathered."""


def _resolved(entries: list, resolve) -> list:
    out = []
    for e in entries:
        try:
            out.append(resolve(e))
        except _Late:
            pass
    return out


def decoded(row: list[float], i: int) -> float:
    """Entry ``i`` of a call's statistics: ``row[i]``, or for ``~i`` (a negative index: a
    statistic derived, not computed, see :meth:`recorder.slots.Slots.relu`) its ReLU."""
    if i >= 0:
        return row[i]
    v = row[~i]
    return v if v > 0.0 or math.isnan(v) else 0.0


def _finite_pair(row: list[float], lo: int, hi: int, allowed: bool = False) -> bool:
    return pair_ok(decoded(row, lo), decoded(row, hi), allowed)


def decode_call(row: list[float], call: tuple) -> dict[str, Any]:
    """One call's statistics from a host copy of its row."""
    midx, mb, order, outs, stats, ins = call
    outs = [(decoded(row, a), decoded(row, b)) for a, b in outs]
    lo = min((a for a, _ in outs), default=math.nan)
    hi = max((b for _, b in outs), default=math.nan)
    if any(math.isnan(a) or math.isnan(b) for a, b in outs):
        lo = hi = math.nan
    mean = rms = math.nan
    if stats is not None:
        n = stats[2]
        mean, rms = row[stats[0]] / n, row[stats[1]] / math.sqrt(n)
    nan = bool(outs) and math.isnan(lo)  # no floating output: nothing to be non-finite
    return {
        "module": midx, "micro_batch": mb, "order": order, "min": lo, "max": hi,
        "absmax": math.nan if nan else max(abs(lo), abs(hi)),
        "mean": mean, "rms": rms,
        "nan": nan,
        "posinf": None if nan else any(b == math.inf for _, b in outs),
        "neginf": None if nan else any(a == -math.inf for a, _ in outs),
        "inputs_finite": all(_finite_pair(row, a, b, al) for a, b, al in ins),
        # the same, with every +-Inf counted (allowed or not) / with only NaN counted
        "inputs_all_finite": all(_finite_pair(row, a, b) for a, b, _ in ins),
        "inputs_nan_free": all(_finite_pair(row, a, b, True) for a, b, _ in ins),
        "outputs_finite": all(pair_ok(a, b) for a, b in outs),
    }


def _max_ref(call: tuple) -> int:
    """The highest row index a decoded call reads."""
    _, _, _, outs, stats, ins = call
    refs = [k for pair in outs for k in pair] + [k for a, b, _ in ins for k in (a, b)]
    if stats is not None:
        refs += stats[:2]
    return max((k if k >= 0 else ~k for k in refs), default=-1)


def _root(square: float) -> float:
    """The norm of a squared norm; NaN for what no squared norm can be (a bundle is written
    whatever a row holds)."""
    return math.sqrt(square) if square >= 0 else math.nan


def _root_sum(squares: list[float]) -> float:
    return _root(sum(squares)) if squares else math.nan


class RingBuffer:
    """Device ring of per-step rows plus their host layouts.

    Memory is allocated at the first step, as ``history x width`` float32 where width is twice
    the first row's length. A row is a step's slots copied whole, so rows keep one length
    while the slots do; when the slots grow (a step that asked for more than they had), the
    ring is made wider once for the rows of that size (``grow``). A longer row of a step that
    ran short is stored truncated (and counted in ``truncated``).
    """

    def __init__(self, history: int):
        self.history = history
        self.rows: torch.Tensor | None = None
        self.device: torch.device | None = None  # the rows' (``rows.device`` makes an object)
        self.layouts: deque[StepLayout] = deque(maxlen=history)
        self._next = 0
        self.truncated = 0
        self._raw: tuple | None = None  # the last refs committed, shared while they repeat
        self._raw_key: int | None = None  # their hash

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else self.rows.numel() * self.rows.element_size()

    def reserve(self, n: int, device: torch.device, grow: bool = True) -> torch.Tensor:
        """Storage for the next row's first ``n`` entries (allocated at the first step); a row
        longer than the ring's width makes it wider (``grow``), else gets its first ``width``
        entries (see ``truncated``)."""
        if self.rows is None:
            self._allocate(max(256, 2 * n), device)
        elif n > self.rows.shape[1] and grow:
            self._allocate(n, device)
        if n > self.rows.shape[1]:
            self.truncated += 1
            n = self.rows.shape[1]
        view = self._views[self._next]
        if view is None or view.numel() != n:  # the row length rarely changes between steps
            view = self._views[self._next] = self._slots[self._next].narrow(0, 0, n)
        self._length = n
        return view

    def _allocate(self, width: int, device: torch.device) -> None:
        """``history x width`` rows (the stored rows copied over, NaN past them), and the views
        the per-step path reuses."""
        rows = torch.full((self.history, width), math.nan, dtype=torch.float32, device=device)
        if self.rows is not None:
            rows[:, : self.rows.shape[1]].copy_(self.rows)
        self.rows, self.device = rows, device
        self._slots = rows.unbind(0)  # row views made once, not per step
        self._views: list = [None] * self.history
        self._checked: list = [None] * self.history
        self._parts: list = [(None, None)] * self.history
        self._zeros = torch.zeros(width, dtype=torch.float32, device=device)
        self._zeros_view = self._zeros
        self._probe = torch.zeros((), dtype=torch.float32, device=device)

    def check_row(self, checked: int, start: int, n: int, finite: torch.Tensor,
                  nan_sq: torch.Tensor) -> None:
        """Both checks of the reserved row, into two 0-d tensors: ``finite`` is 0 when its
        first ``checked`` entries are finite, else NaN (:meth:`probe_finite`); ``nan_sq`` (when
        ``n``) is the sum of squares of its ``n`` entries from ``start``, NaN exactly when one
        is NaN (+-Inf squares to +Inf). The part's view is made again only when it moves."""
        if checked:
            self.probe_finite(checked, out=finite)
        else:
            finite.zero_()
        if n:  # (a dot: the kernel the gradient norms just ran, warm)
            view, at = self._parts[self._next]
            if at != (start, n):
                view = self._slots[self._next].narrow(0, start, n)
                self._parts[self._next] = (view, (start, n))
            torch.dot(view, view, out=nan_sq)

    def probe_finite(self, s: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A 0-d tensor that is 0 when the first ``s`` entries of the reserved row are all
        finite and NaN otherwise, in one device op: ``x * 0`` is 0 for every finite ``x`` and
        NaN for NaN and +-Inf, and a sum of zeros cannot overflow (``isfinite().all()`` is
        several ops and allocations; on this path each one counts)."""
        view = self._checked[self._next]
        if view is None or view.numel() != s:
            view = self._checked[self._next] = self._slots[self._next].narrow(0, 0, s)
        zeros = self._zeros_view
        if zeros.numel() != s:
            zeros = self._zeros_view = self._zeros.narrow(0, 0, s)
        return torch.dot(view, zeros, out=self._probe if out is None else out)

    def commit(self, layout: StepLayout) -> None:
        """Keep the row last reserved, described by ``layout``. A training loop's steps take
        the same slots in the same order: one shared copy of their refs then serves every
        row, so the history holds no objects per step (letting go of the step ``history``
        steps ago touched every one of them, cold after the steps since), told by a hash of
        this step's refs (the shared copy is not read: it is as cold)."""
        layout.length = self._length
        try:
            key = hash(layout.raw)
        except TypeError:  # (a ref that is no tuple of numbers: kept as it is)
            key = None
        if key is None or key != self._raw_key:
            self._raw, self._raw_key = layout.raw, key
        layout.raw = self._raw
        self.layouts.append(layout)
        self._next = (self._next + 1) % self.history

    def ordered_rows(self) -> list[list[float]]:
        """Host copies of the stored rows, oldest first (a transfer: event time only)."""
        if self.rows is None:
            return []
        k = len(self.layouts)
        idx = [(self._next - k + i) % self.history for i in range(k)]
        host = self.rows[idx].cpu().tolist()
        return [r[: lay.length] + [math.nan] * (len(r) - lay.length)
                for r, lay in zip(host, self.layouts)]

    def export(self, n_params: int, n_groups: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Decode every stored step into the fixed tables the bundle holds (``ring/*``)."""
        rows = self.ordered_rows()
        h = len(rows)
        for lay in self.layouts:
            lay.materialize()
        width = max((len(lay.calls) for lay in self.layouts), default=0)
        nan = math.nan
        t = {"ring/calls": torch.full((h, width, len(CALL_FIELDS)), nan),
             "ring/call_module": torch.full((h, width), -1, dtype=torch.int32),
             "ring/call_micro_batch": torch.full((h, width), -1, dtype=torch.int32),
             "ring/grad_norms": torch.full((h, n_params), nan),
             "ring/param_norms": torch.full((h, n_params), nan),
             "ring/update_norms": torch.full((h, n_params), nan),
             "ring/grad_norm": torch.full((h,), nan, dtype=torch.float64),
             "ring/param_norm": torch.full((h,), nan, dtype=torch.float64),
             "ring/loss": torch.full((h,), nan, dtype=torch.float64),
             "ring/lr": torch.full((h, max(n_groups, 1)), nan, dtype=torch.float64),
             "ring/scale": torch.full((h,), nan, dtype=torch.float64)}
        for i, (row, lay) in enumerate(zip(rows, self.layouts)):
            _export_step(i, row, lay, t)
        order = ("ring/calls", "ring/call_module", "ring/call_micro_batch", "ring/grad_norms",
                 "ring/param_norms", "ring/update_norms", "ring/grad_norm", "ring/param_norm",
                 "ring/loss", "ring/lr", "ring/scale")
        tensors = {
            "ring/steps": torch.tensor([lay.step for lay in self.layouts], dtype=torch.int64),
            **{k: t[k] for k in order},
            "ring/skipped": torch.tensor([lay.skipped for lay in self.layouts], dtype=torch.bool),
        }
        meta = {"history": self.history, "stored": h, "call_fields": list(CALL_FIELDS),
                "truncated_rows": self.truncated, "device_bytes": self.nbytes}
        return meta, tensors


def _export_step(i: int, row: list[float], lay: StepLayout, t: dict[str, torch.Tensor]) -> None:
    """Fill row ``i`` of the export tables ``t`` from one stored step. A step wider than the
    ring was stored cut at ``lay.length``: what lies past the cut stays unknown (NaN, module
    -1), never a made-up value."""
    n = lay.length
    for j, call in enumerate(lay.calls):
        if _max_ref(call) >= n:
            continue
        d = decode_call(row, call)
        t["ring/calls"][i, j] = torch.tensor([d[f] if d[f] is not None else math.nan
                                              for f in CALL_FIELDS], dtype=torch.float32)
        t["ring/call_module"][i, j], t["ring/call_micro_batch"][i, j] = \
            d["module"], d["micro_batch"]
    if lay.loss and all(b < n for _, _, b in lay.loss):
        vals = [row[b] for _, _, b in lay.loss]
        t["ring/loss"][i] = sum(vals) / len(vals)
    # rows hold squared norms; gradients as backward wrote them (scaled under AMP)
    unscale = lay.scale if lay.grads_scaled and lay.scale else 1.0
    for key, pairs, div in (("grad_norms", lay.grads, unscale), ("param_norms", lay.params, 1.0),
                            ("update_norms", lay.updates, 1.0)):
        for p, k in pairs:
            if k < n:
                t[f"ring/{key}"][i, p] = _root(row[k]) / div
    if all(k < n for _, k in lay.grads):
        t["ring/grad_norm"][i] = _root_sum([row[k] for _, k in lay.grads]) / unscale
    if all(k < n for _, k in lay.params):
        t["ring/param_norm"][i] = _root_sum([row[k] for _, k in lay.params])
    lr = t["ring/lr"]
    for g, v in enumerate(lay.lrs[: lr.shape[1]]):
        lr[i, g] = float(v)  # (a device tensor's copy: read now, see cycle._host_float)
    if lay.scale is not None:
        t["ring/scale"][i] = lay.scale
