"""Which of the model's parameters an op took as its input: the parameter itself, a view of
it (an element, ``log(self.sigma[i])``), the rows an embedding lookup took
(``exp(self.log_df(idx))``), or a copy of its values an op made without changing
them (``torch.diagonal(torch.tril(self.chol))``: an SVGP's Cholesky factor, whose diagonal
an update stepped to 0), so that the hint names the parameter to keep in the op's domain; a
division's divisor also when an op made it of one parameter alone (RMTPP's ``w.clamp(min=0)``,
which training takes to exactly 0); and the buffer an op's input was looked up in
(``log(self.q[targets])``, also once scaled, ``self.counts[ids] / total``, or taken value by
value to a 0 kept, ``self.alphas_cumprod[t].sqrt()``: a table the code was built with, named by
:mod:`replay.looked_up`)."""

from __future__ import annotations

import weakref

import torch

from .batch_written import BatchWritten
from .wrapped_load import plain_parts

# ops whose output holds some of their one floating input's values, unchanged
_COPIES = {"tril", "triu", "clone", "_to_copy", "contiguous", "diagonal_copy", "index",
           "index_select", "gather", "take_along_dim", "masked_select", "repeat", "expand_copy",
           "embedding"}
# divisions: their divisor alone decides the pole every quotient shares
_DIVISIONS = {"div", "true_divide"}

# a number added to one value: ``alpha - 2`` is 0 at alpha = 2, no zero of alpha's
_SHIFTS = {"sub", "add", "rsub"}

# differences of entries: a divisor made so of one buffer is 0 where two entries are equal
_DIFFERENCES = {"sub", "rsub", "diff"}

# those that pick entries by index (a buffer's: a table looked up by the batch's ids)
_LOOKUPS = {"index", "index_select", "gather", "take_along_dim", "embedding"}
# a looked-up table's values scaled (its first input), its zeros kept: ``counts[ids] / total``;
# or a table scaled by a number before the lookup: ``(counts / counts.sum())[ids]``
_SCALINGS = {"div", "mul"}
# value by value, 0 where the entry is 0: a noise schedule's ``alphas_cumprod[t].sqrt()``, and
# an SNR squared from it, ``(a.sqrt() / (1 - a).sqrt()) ** 2`` (diffusers' ``compute_snr``; a
# negative power's infinity at 0 is no 0 kept, which the pole's own check then refuses)
_ZERO_KEEPING = {"sqrt", "abs", "neg", "square", "relu", "pow"}


def divisor_of(op: str | None, ins: list[torch.Tensor]) -> torch.Tensor | None:
    """The divisor of a division ``op`` took (``x / d``; ``1 / d``, which Python's ``1.0 /
    t`` runs as ``reciprocal``: a class-balanced weight's ``1 / E_n``), else None."""
    if op in _DIVISIONS and len(ins) == 2:
        return ins[1]
    return ins[0] if op == "reciprocal" and len(ins) == 1 else None


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # (a tensor without storage)
        return None


class ParamNames:
    def __init__(self):
        # (data_ptr, shape) and ("storage", ptr) -> the name of the model's parameter there
        self.params: dict[tuple, str] = {}
        # the storage of a copy an op made of a parameter's values -> (the copy, the name)
        self._copies: dict[int, tuple[weakref.ref, str]] = {}
        # id of a value an op made of one parameter alone (``w.clamp(min=0)``) -> (it, name):
        # named as a division's divisor only, whose pole that parameter then decides
        self._derived: dict[int, tuple[weakref.ref, str]] = {}
        # id of a value an op made of one parameter of one entry shifted by a number
        # (``|alpha - 2|``, Barron's loss at its L2 point): 0 where the parameter equals that
        # number, not at 0 -> (it, the name, the value that was shifted); and the divisor of
        # the last division ``among(..., hit=True)`` so made: (the name, that value)
        self._shifted: dict[int, tuple[weakref.ref, str, float]] = {}
        self.hit_divisor_shifted: tuple[str, float] | None = None
        # a floating buffer's storage -> its name; a copy's, made of its values, -> (the copy,
        # the name, whether an op picked entries of it by index on the way)
        self._tables: dict[int, str] = {}
        self._table_copies: dict[int, tuple[weakref.ref, str, bool]] = {}
        # (the buffer, which input) an input of the last op ``among(..., hit=True)`` was asked
        # about was looked up in: the op finder asks as it blames an op
        self.hit_buffer: tuple[str, int] | None = None
        # id of a value ops made of one buffer's values alone by a difference of its entries
        # (a spline's knot spans ``grid[:, 1:] - grid[:, :-1]``), or of two buffers' (a fitted
        # range ``self.hi - self.lo``: named "hi - lo") -> (it, the name); and the
        # buffer the divisor of the last division ``among(..., hit=True)`` was so made of
        self._of_buffer: dict[int, tuple[weakref.ref, str]] = {}
        self.hit_divisor_buffer: str | None = None
        # the buffer the divisor of that division is, as is, a view or an unchanged copy (a
        # statistic kept by the code: ``x / self.std``, ``p / self.p_model``)
        self.hit_divisor_held: str | None = None
        # id of a value ops made of buffers' values alone, each taken whole (``self.std +
        # self.eps``, ``self.running_var.sqrt()``, a frequency's ``sqrt(2 * p * (1 - p))``)
        # -> (it, their names); the names the divisor of that division was so made of, and
        # that divisor (detached)
        self._kept: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}
        self.hit_divisor_kept: tuple[str, ...] | None = None
        self.hit_divisor: torch.Tensor | None = None
        # id of a sum of the batch's values and one parameter of one entry (``mask + lam``: a
        # learned weight as the divisor's eps) -> (it, the name); the name at the last division
        self._offsets: dict[int, tuple[weakref.ref, str]] = {}
        self.hit_divisor_offset: str | None = None
        # the buffers the forward wrote in place from the batch (replay.batch_written)
        self.written = BatchWritten()

    def index(self, named, buffers=()) -> None:
        """Name the parameters ``named`` yields (``model.named_parameters()``), by address
        and shape and by their storage (a view of one); and the floating ``buffers``
        (``model.named_buffers()``) by their storage."""
        self.params, self._copies, self._derived = {}, {}, {}
        self._shifted, self.hit_divisor_shifted = {}, None
        self._table_copies, self.hit_buffer = {}, None
        self._of_buffer, self.hit_divisor_buffer, self.hit_divisor_held = {}, None, None
        self._kept, self.hit_divisor_kept, self.hit_divisor = {}, None, None
        self._offsets, self.hit_divisor_offset = {}, None
        self._tables = {p: n for n, b in buffers
                        if b.is_floating_point() and (p := _storage(b)) is not None}
        storages: dict[int, str | None] = {}
        for n, p in named:
            for q in plain_parts(p):  # (a wrapper subclass, QLoRA's int8 weight: its inner ones)
                self.params[(q.data_ptr(), tuple(q.shape))] = n
                ptr = q.untyped_storage().data_ptr()
                storages[ptr] = n if ptr not in storages else None  # (shared storage: neither)
        self.params.update({("storage", k): v for k, v in storages.items() if v is not None})

    def among(self, ins: list[torch.Tensor], op: str | None = None, hit: bool = False
              ) -> str | None:
        """The name of the op's one floating input when that is one of the model's
        parameters (a learnable scale or temperature used as is: ``logit_scale.exp()``), a
        view or an unchanged copy of one; of a division's divisor (``x / self.w``: RMTPP's
        closed-form integral over its learned ``w``). Not for other ops of several inputs: a
        Linear's ``addmm`` takes its bias and weight with every input, and what overflows
        there is the product, not the bias. ``hit``: the op is being blamed; keep the buffer
        one of its inputs was looked up in by index (``hit_buffer``)."""
        if hit:
            self.hit_buffer = next(((b[0], i) for i, t in enumerate(ins)
                                    if (b := self._table_of(t)) is not None and b[1]), None)
        if hit:  # (a divisor ``|alpha - 2|``: the value of alpha it is 0 at)
            div = divisor_of(op, ins)
            self.hit_divisor_shifted = None if div is None else self._shifted_of(div)
        if hit and (div := divisor_of(op, ins)) is not None:
            self.hit_divisor_buffer = self._differenced(div)
            held = self._table_of(div)
            self.hit_divisor_held = held[0] if held is not None and not held[1] else None
            self.hit_divisor_kept = self._kept_of(div)
            self.hit_divisor = div.detach() if self.hit_divisor_kept else None
            off = self._offsets.get(id(div))
            self.hit_divisor_offset = off[1] if off is not None and off[0]() is div else None
        if op in _DIVISIONS and len(ins) == 2:
            return self.among(ins[1:]) or self._derived_from(ins[1])
        if not self.params or len(ins) != 1:
            return None
        found = self.params.get((ins[0].data_ptr(), tuple(ins[0].shape)))
        ptr = _storage(ins[0])
        if found or ptr is None:
            return found
        copy = self._copies.get(ptr)
        if copy is not None and copy[0]() is not None:
            return copy[1]
        return self.params.get(("storage", ptr))

    def _derived_from(self, t: torch.Tensor) -> str | None:
        hit = self._derived.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Follow a copy an op made of a parameter's values (``torch.tril(L)``) or of a
        buffer's (``self.q[targets]``), and a value made of one parameter alone, value by
        value (``self.w.clamp(min=0)``, ``F.relu``)."""
        if name in _COPIES | _LOOKUPS and len(ins) == 1 and len(outs) == 1 \
                and (b := self._table_of(ins[0])) is not None \
                and (ptr := _storage(outs[0])) is not None:
            self._table_copies[ptr] = (weakref.ref(outs[0]), b[0], b[1] or name in _LOOKUPS)
        elif name in _SCALINGS | _ZERO_KEEPING and len(outs) == 1 and ins \
                and (b := self._table_of(ins[0])) \
                and (b[1] or name in _SCALINGS and len(ins) == 2 and ins[1].numel() == 1) \
                and (ptr := _storage(outs[0])) is not None:
            # (q = counts[i] / n, alphas_cumprod[t].sqrt(); or normalised by a 0-d tensor
            # first, then looked up: (h / h.sum())[n]; a Python number's 2 * p is no copy)
            self._table_copies[ptr] = (weakref.ref(outs[0]), b[0], b[1])
        self._track_buffer(name, ins, outs)
        self._track_kept(ins, outs)
        if name == "add" and len(ins) == 2 and len(outs) == 1 and self.params:
            # (one addend a parameter of one entry, the other bigger: ``mask + lam``)
            found = [self.among([t]) if t.numel() == 1 else None for t in ins]
            if sum(f is not None for f in found) == 1 and outs[0].numel() > 1:
                param = found[0] or found[1]
                self._offsets[id(outs[0])] = (weakref.ref(outs[0]), param)
        if not self.params or len(outs) != 1 or len(ins) != 1 or ins[0].is_nested \
                or ins[0].layout != torch.strided:  # (no data pointer to name it by)
            return
        direct = self.among(ins)
        self._track_shift(name, ins[0], outs[0], direct)
        if direct is not None and name in _COPIES and (ptr := _storage(outs[0])) is not None:
            self._copies[ptr] = (weakref.ref(outs[0]), direct)
        elif (param := direct or self._derived_from(ins[0])) is not None \
                and outs[0].numel() == ins[0].numel():  # (value by value: no norm, no sum)
            self._derived[id(outs[0])] = (weakref.ref(outs[0]), param)

    def _track_shift(self, name: str, t: torch.Tensor, out: torch.Tensor, direct: str | None
                     ) -> None:
        """Follow a value made of one parameter of one entry by adding a number to it (its
        zero moved to another value of the parameter), or of such a value, value by value."""
        shifted = self._shifted_of(t)
        if shifted is None and name in _SHIFTS and t.numel() == 1 \
                and (param := direct or self._derived_from(t)) is not None:
            shifted = (param, float(t.detach()))
        if shifted is not None and out.numel() == t.numel():
            self._shifted[id(out)] = (weakref.ref(out), *shifted)

    def _shifted_of(self, t: torch.Tensor) -> tuple[str, float] | None:
        hit = self._shifted.get(id(t))
        return hit[1:] if hit is not None and hit[0]() is t else None

    def _track_buffer(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]
                      ) -> None:
        """Outputs of a difference of one buffer's entries (views of it, copies), and of ops
        on those alone, named by that buffer (a running variance divided by is not one)."""
        floats = [t for t in ins if t.is_floating_point()]
        names = {self._buffer_of(t) for t in floats}
        if name in _DIFFERENCES and len(floats) == 2 and len(names) == 2 and None not in names:
            # two buffers' difference (a fitted range ``self.hi - self.lo``), named as written
            pair = [self._buffer_of(t) for t in (floats[::-1] if name == "rsub" else floats)]
            names = {f"{pair[0]} - {pair[1]}"}
        elif len(names) != 1 or None in names or not self._tables:
            return
        if name not in _DIFFERENCES and not any(self._differenced(t) for t in floats):
            return
        name = names.pop()
        for t in outs:
            self._of_buffer[id(t)] = (weakref.ref(t), name)

    def _track_kept(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Outputs of an op whose floating inputs are all buffers taken whole, or values made
        so (no batch, no parameter, no lookup by the batch's ids), named by those buffers."""
        floats = [t for t in ins if t.is_floating_point()]
        if not floats or not self._tables:
            return
        made = [self._kept_of(t) for t in floats]
        if any(m is None for m in made):
            return
        names = tuple(dict.fromkeys(n for m in made for n in m))
        for t in outs:
            self._kept[id(t)] = (weakref.ref(t), names)

    def _kept_of(self, t: torch.Tensor) -> tuple[str, ...] | None:
        if (b := self._table_of(t)) is not None:
            return None if b[1] else (b[0],)
        hit = self._kept.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _buffer_of(self, t: torch.Tensor) -> str | None:
        if (b := self._table_of(t)) is not None:
            return b[0]
        return self._differenced(t)

    def _differenced(self, t: torch.Tensor) -> str | None:
        hit = self._of_buffer.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def buffer_at(self, t: torch.Tensor) -> str | None:
        """The name of the floating buffer ``t`` is, or a view of (its storage), or None."""
        ptr = _storage(t)
        return None if ptr is None else self._tables.get(ptr)

    def _table_of(self, t: torch.Tensor) -> tuple[str, bool] | None:
        """(the buffer ``t`` holds values of, whether picked by index), or None."""
        ptr = _storage(t)
        if ptr is None or (found := self._tables.get(ptr)) is not None:
            return None if ptr is None else (found, False)
        copy = self._table_copies.get(ptr)
        return copy[1:] if copy is not None and copy[0]() is not None else None
