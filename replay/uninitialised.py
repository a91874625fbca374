"""Memory an allocator op handed out unwritten (``torch.empty``, ``new_empty``, ``empty_like``)
and read before every entry of it was written.

Under ``torch.use_deterministic_algorithms(True)`` torch fills such memory with NaN
(``torch.utils.deterministic.fill_uninitialized_memory``, which the replay sets as the run had
it); otherwise it holds what the allocator's memory held, now and then NaN. No op computed that
NaN, so the op finder passes over allocations, and a buffer written in full afterwards is
harmless. :class:`Unwritten` remembers the allocations the fill made NaN, by storage, with the
line that made them, and gives their NaN a payload of its own (a NaN written in later, a literal
fill or a corrupt row, is no unwritten entry); the first op that reads such entries (neither a
view of the allocation nor a write into it) and makes a non-finite value before any op made one
of finite values blames the allocation: those entries were never written. The factory's
parameters and buffers are told so too (``nn.Parameter(torch.empty(d, d))`` never
initialised: :func:`built_hint`).
"""

from __future__ import annotations

import inspect
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
_KEPT = 64  # allocations remembered at most
# a quiet NaN of a payload of its own per type (as integers of the type's width): what an
# allocation held when it was made, told apart from a NaN written into it later (a literal
# fill, a corrupt row), whose payload is another
_TAGS = {torch.float32: (torch.int32, 0x7FC0DEAD),
         torch.float64: (torch.int64, 0x7FF80000DEAD0000),
         torch.float16: (torch.int16, 0x7E5A), torch.bfloat16: (torch.int16, 0x7FDA)}


class Unwritten:
    """The allocations deterministic mode filled with NaN in the watched code."""

    def __init__(self) -> None:
        # storage -> (the allocated tensor, held: ``nn.Parameter(torch.empty(..))`` drops it
        # and keeps its storage, which must not be freed and reused under another tensor;
        # the hit that blames it, rows and entries still to fill in), the latest few
        self.held: dict[int, tuple[torch.Tensor, OpHit]] = {}
        self.by_to_empty: set[int] = set()  # (storages nn.Module.to_empty allocated)

    def allocated(self, name: str, out: Any, op: str, occurrence: int, seq: int,
                  within: tuple[str, int] | None) -> Any:
        """Remember ``out``, allocator ``op``'s result, when deterministic mode's fill made it
        all NaN, with the line that ran it; returns ``out``. Not garbage that happened to hold
        NaN: a NaN written into it later (a checkpoint's corrupt row loaded into an
        ``nn.Linear`` whose ``torch.empty`` held some) cannot be told from it, and the
        allocation would take the blame for what the load wrote."""
        # (a meta tensor holds no memory to read: a factory building on the meta device)
        if name not in ALLOCATORS or not isinstance(out, torch.Tensor) or out.is_meta \
                or out.dtype not in _TAGS or not out.numel() or not bool(out.isnan().all()):
            return out
        if (key := storage_of(out)) is not None:
            # (NaN still, of the payload no later write gives)
            out.detach().view(_TAGS[out.dtype][0]).fill_(_TAGS[out.dtype][1])
            self.held.pop(key, None)
            if _in_to_empty():
                self.by_to_empty.add(key)
            self.held[key] = (out, OpHit(
                op, kind_of(out) or "nan", user_source(), None, None, occurrence=occurrence,
                inputs_finite=True, within=within, seq=seq))
            if len(self.held) > _KEPT:  # (a loop allocating a buffer a step: the oldest go)
                del self.held[next(iter(self.held))]
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
            if key is None or key in written or key not in self.held or not _unwritten(t):
                continue
            whole, hit = self.held[key]
            hit.rows = rows([t])
            hit.unwritten = _entries(whole)
            return hit
        return None

    def of(self, t: torch.Tensor) -> OpHit | None:
        """The allocation ``t`` is (a view of), alive and still holding a non-finite value."""
        whole, hit = self.held.get(storage_of(t), (None, None))
        # (every non-finite entry unwritten: not a NaN written in later, a corrupt row)
        n = _unwritten(t)
        if whole is None or not n or int((~torch.isfinite(t.detach())).sum()) != n:
            return None
        hit.unwritten = _entries(whole)
        return hit


def built_hint(unwritten: Unwritten, tensors: list[torch.Tensor], names: str) -> str | None:
    """The hint for parameters or buffers ``names`` the factory builds non-finite when each is
    an allocation it never wrote in full (``nn.Parameter(torch.empty(d, d))`` without an
    init; a scratch buffer a forward fills only as far as its batch reaches)."""
    hits = [unwritten.of(t) for t in tensors]
    if not hits or any(h is None for h in hits) or len({(h.op, h.source) for h in hits}) > 1:
        return None
    h = hits[0]
    if all(storage_of(t) in unwritten.by_to_empty for t in tensors):
        return (f"the factory builds {names} non-finite: Module.to_empty at {h.source} "
                f"allocated it without initialising it (as it does every parameter and "
                f"buffer), and {h.unwritten} (torch.use_deterministic_algorithms(True) fills "
                "such memory with NaN; otherwise it holds whatever was there, different in "
                "each run): the initialisation run after to_empty (init_weights, "
                "reset_parameters) must write it, non-persistent buffers (a RoPE table, a "
                "causal mask) included, which no state_dict load writes")
    return (f"the factory builds {names} non-finite: {h.op} at {h.source} allocated "
            f"it without initialising it, and {h.unwritten} ("
            "torch.use_deterministic_algorithms(True) fills such memory with NaN; otherwise it "
            "holds whatever was there, different in each run): initialise it where it is made "
            "(torch.zeros / torch.full, or an init such as nn.init.xavier_uniform_ for a "
            "weight), and write every entry a forward reads (the rows past a smaller batch "
            "of a buffer it fills per step)")


def _in_to_empty() -> bool:
    """Whether ``nn.Module.to_empty`` is on the stack (its ``empty_like`` of a meta tensor)."""
    f = inspect.currentframe()
    while f is not None:
        if f.f_code.co_name == "to_empty" and "torch" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


def _unwritten(t: torch.Tensor) -> int:
    """How many entries of ``t`` hold the NaN its allocation was made with (unwritten)."""
    if not t.numel() or t.dtype not in _TAGS or finite(t):
        return 0
    ints, tag = _TAGS[t.dtype]
    return int((t.detach().view(ints) == tag).sum())


def _entries(t: torch.Tensor) -> str:
    """How many entries of allocation ``t`` are still unwritten, of how many: said as "N of M
    entries of its (shape) result were never written"."""
    return f"{_unwritten(t)} of {t.numel()} entries of its {tuple(t.shape)} result were never written"


def hint(hit: OpHit) -> str | None:
    """The hint of an allocation's hit, whose cause is ``invalid``: no arithmetic made the
    value, the program read memory it never wrote (a code bug, as a 0/0 is; not the data's,
    the weights', or a range's); None for another hit."""
    if not hit.unwritten:
        return None
    return (f"{hit.op} allocated memory without initialising it, and "
            f"{hit.unwritten} before the step read them ("
            "torch.use_deterministic_algorithms(True) fills such memory with NaN; "
            "otherwise it holds whatever was there): allocate it with torch.zeros / "
            "new_zeros / torch.full (the padding's value), or write every entry before "
            "reading it (the rows or positions a branch, a loop over lengths or an index "
            "skips)")
