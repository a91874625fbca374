"""Which of the model's parameters an op took as its input: the parameter itself, a view of
it (an element, ``log(self.sigma[i])``), or a copy of its values an op made without changing
them (``torch.diagonal(torch.tril(self.chol))``: an SVGP's Cholesky factor, whose diagonal
an update stepped to 0), so that the hint names the parameter to keep in the op's domain."""

from __future__ import annotations

import weakref

import torch

# ops whose output holds some of their one floating input's values, unchanged
_COPIES = {"tril", "triu", "clone", "_to_copy", "contiguous", "diagonal_copy", "index",
           "index_select", "gather", "take_along_dim", "masked_select", "repeat", "expand_copy"}
# divisions: their divisor alone decides the pole every quotient shares
_DIVISIONS = {"div", "true_divide"}


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

    def index(self, named) -> None:
        """Name the parameters ``named`` yields (``model.named_parameters()``), by address
        and shape and by their storage (a view of one)."""
        self.params, self._copies = {}, {}
        storages: dict[int, str | None] = {}
        for n, p in named:
            self.params[(p.data_ptr(), tuple(p.shape))] = n
            ptr = p.untyped_storage().data_ptr()
            storages[ptr] = n if ptr not in storages else None  # (shared storage: neither)
        self.params.update({("storage", k): v for k, v in storages.items() if v is not None})

    def among(self, ins: list[torch.Tensor], op: str | None = None) -> str | None:
        """The name of the op's one floating input when that is one of the model's
        parameters (a learnable scale or temperature used as is: ``logit_scale.exp()``), a
        view or an unchanged copy of one; of a division's divisor (``x / self.w``: RMTPP's
        closed-form integral over its learned ``w``). Not for other ops of several inputs: a
        Linear's ``addmm`` takes its bias and weight with every input, and what overflows
        there is the product, not the bias."""
        if op in _DIVISIONS and len(ins) == 2:
            ins = ins[1:]
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

    def track(self, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Follow a copy an op made of a parameter's values (``torch.tril(L)``)."""
        if name in _COPIES and self.params and len(outs) == 1 \
                and (param := self.among(ins)) is not None \
                and (ptr := _storage(outs[0])) is not None:
            self._copies[ptr] = (weakref.ref(outs[0]), param)
