"""Memory an allocator op handed out unwritten (``torch.empty``, ``new_empty``, ``empty_like``)
and read before every entry of it was written.

Under ``torch.use_deterministic_algorithms(True)`` torch fills such memory with NaN
(``torch.utils.deterministic.fill_uninitialized_memory``, which the replay sets as the run had
it); otherwise it holds what the allocator's memory held, now and then NaN. No op computed that
NaN, so the op finder passes over allocations, and a buffer written in full afterwards is
harmless. :class:`Unwritten` remembers the allocations that hold NaN, by storage, with the line
that made them; the first op that reads one (neither a view of it nor a write into it) while
its NaN is still there, and makes a non-finite value before any op made one of finite values,
blames the allocation: those entries were never written.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from recorder.finite import finite, kind_of

from .hits import OpHit
from .source import user_source
from .storages import storage_of

# ops whose output's values are whatever the memory held
ALLOCATORS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                        "new_empty_strided", "resize_"})
# the ops the finder passes over: those, and ``set_`` (a tensor's values, which it saw made)
PASSED_OVER = ALLOCATORS | {"set_"}


class Unwritten:
    """The allocations holding NaN (or another non-finite value) in the watched code."""

    def __init__(self) -> None:
        # storage -> (the allocated tensor, weakly: its storage may be freed and reused;
        # the hit that blames it, rows and entries still to fill in)
        self.held: dict[int, tuple[weakref.ref, OpHit]] = {}

    def allocated(self, name: str, out: Any, op: str, occurrence: int, seq: int,
                  within: tuple[str, int] | None) -> Any:
        """Remember ``out``, allocator ``op``'s result, when it holds a non-finite value, with
        the line that ran it; returns ``out``."""
        if name not in ALLOCATORS or not isinstance(out, torch.Tensor) \
                or not out.is_floating_point() or finite(out):
            return out
        if (key := storage_of(out)) is not None:
            self.held[key] = (weakref.ref(out), OpHit(
                op, kind_of(out) or "nan", user_source(), None, None, occurrence=occurrence,
                inputs_finite=True, within=within, seq=seq))
        return out

    def read(self, ins: list[torch.Tensor], outs: list[torch.Tensor], rows) -> OpHit | None:
        """The allocation a non-finite input of this op is (a view of), when the op only reads
        it and made a non-finite value; its hit, with the samples ``rows`` gives of that input
        and how many entries were still unwritten."""
        if not self.held or all(finite(t) for t in outs):
            return None
        written = {storage_of(t) for t in outs}
        for t in ins:
            key = storage_of(t)
            if key is None or key in written or key not in self.held or finite(t):
                continue
            base, hit = self.held[key]
            whole = base()
            if whole is None or storage_of(whole) != key:  # (freed: its memory reused)
                continue
            hit.rows = rows([t])
            hit.unwritten = _entries(whole)
            return hit
        return None


def _entries(t: torch.Tensor) -> str:
    """How many entries of allocation ``t`` are still unwritten (non-finite), of how many."""
    bad = int((~torch.isfinite(t.detach())).sum())
    return f"{bad} of {t.numel()} entries of its {tuple(t.shape)} result"


def hint(hit: OpHit) -> str | None:
    """The hint of an allocation's hit, whose cause is ``invalid``: no arithmetic made the
    value, the program read memory it never wrote (a code bug, as a 0/0 is; not the data's,
    the weights', or a range's); None for another hit."""
    if not hit.unwritten:
        return None
    return (f"{hit.op} allocated memory without initialising it, and "
            f"{hit.unwritten} were never written before the step read them ("
            "torch.use_deterministic_algorithms(True) fills such memory with NaN; "
            "otherwise it holds whatever was there): allocate it with torch.zeros / "
            "new_zeros / torch.full (the padding's value), or write every entry before "
            "reading it (the rows or positions a branch, a loop over lengths or an index "
            "skips)")
