"""Parameters the model's own forward writes, restored before every re-run.

MoCo's forward updates its key encoder by momentum (``param_k.data = param_k.data * m +
param_q.data * (1 - m)``, facebookresearch/moco and moco-v3), and a model may hold its own EMA
teacher: parameters that require no gradient and that no optimizer updates, which the forward
replaces or writes in place. A re-run of the step must start from them as the step began, as
it does from the buffers, or each re-run moves them again and the re-runs drift apart (two
re-runs that disagree read as nondeterminism). Only frozen parameters are kept (a copy each):
the trained ones change only in an optimizer's ``step()``, which a re-run of the step does
not run, except those the recorder saw the step's own code write (``written_in_step``: TransE's
``weight.data.div_(norm)`` in its forward), kept too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .compat import version
from .float64 import widened


class FrozenParams:
    """The model's parameters that require no gradient, and the trained ones named in
    ``also``, as a run starts from them."""

    def __init__(self, model: nn.Module, also: frozenset[str] = frozenset()):
        self.model = model
        self.saved = {n: p.detach().clone() for n, p in model.named_parameters()
                      if not p.requires_grad or n in also}
        # (the trained ones, always put back: a write through ``.data`` bumps no version)
        self.always = frozenset(also) & set(self.saved)
        self.marks = self._marks()

    def keep(self, written: dict[str, torch.Tensor]) -> None:
        """Put back ``written`` (trained parameters a run's forward wrote through ``.data``,
        by name, as the run began) before every later run too."""
        self.saved.update(written)
        self.always = self.always | frozenset(written)
        self.marks = self._marks()

    def _marks(self) -> dict[str, tuple[int, int]]:
        """Where each kept parameter's data is and its version: ``.data =`` moves the first,
        an in-place write the second."""
        if not self.saved:
            return {}
        return {n: (p.data_ptr(), version(p)) for n, p in self.model.named_parameters()
                if n in self.saved}

    def restore(self) -> None:
        """Put back the kept parameters a run replaced or wrote (none, the usual case: one
        pointer and version read per frozen parameter)."""
        now = self._marks()
        if now == self.marks and not self.always:
            return
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                first = self.saved.get(n)
                if first is not None and (now.get(n) != self.marks.get(n) or n in self.always) \
                        and first.shape == p.shape:
                    p.data = first.clone()
        self.marks = self._marks()

    def written(self) -> list[str]:
        """The kept parameters whose values differ now from the kept ones: after a run, those
        the model's own forward writes (a hand-written spectral norm's ``u.data = ...``)."""
        now = self._marks()
        with torch.no_grad():
            return [n for n, p in self.model.named_parameters()
                    if not p.requires_grad and now.get(n) != self.marks.get(n) and (first := self.saved.get(n))
                    is not None and first.shape == p.shape and not p.is_meta
                    and not torch.allclose(first, p, rtol=0, atol=0, equal_nan=True)]

    @contextlib.contextmanager
    def widened(self):
        """Inside the block, restore float64 copies (:meth:`replay.rerun.Runner.float64`,
        which widens the parameters themselves); after it, the kept ones again."""
        saved = self.saved
        self.saved = {n: t.to(widened(t.dtype) or t.dtype) for n, t in saved.items()}
        try:
            yield
        finally:
            self.saved = saved
