"""A hand-written loop over time steps takes its batch time-major: an NTM's or a DNC's
controller cell, a decoder's ``nn.LSTMCell`` run ``for t in range(x.shape[0])`` over a
``(T, B, F)`` input, its outputs stacked ``(T, B, ...)``. No module says where the batch is
(a cell takes ``(B, F)`` one step at a time), and the loss compares ``(T, B, ...)`` with
``(T, B, ...)``, so the time steps would be taken for the samples. The state such a model
carries between truncated-BPTT chunks tells: passed in and returned with the same shapes
(``h``, ``c``, a memory ``(B, N, W)``, read weights ``(B, N)``), it holds the batch at dim 0,
where the first input and output hold it at dim 1.

>>> x, h, mem = torch.zeros(7, 4, 5), torch.zeros(4, 16), torch.zeros(4, 8, 6)
>>> carried_batch([x, h, mem], [torch.zeros(7, 4, 5), h + 1, mem + 1])
4
>>> carried_batch([torch.zeros(4, 7, 5), h], [torch.zeros(4, 7, 5), h + 1])  # batch first
0
"""

from __future__ import annotations

import torch


def carried_batch(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """The batch size of a time-major loop carrying its state (above), else 0."""
    ins = [t for t in inputs if t.dim() and not t.is_nested]
    outs = [t for t in outputs if t.dim() and not t.is_nested]
    if len(ins) < 2 or len(outs) < 2 or ins[0].dim() < 2 or outs[0].dim() < 2:
        return 0
    returned = {tuple(t.shape) for t in outs[1:]}
    states = [t for t in ins[1:] if tuple(t.shape) in returned]
    sizes = {t.shape[0] for t in states}
    if len(sizes) != 1:
        return 0
    (n,) = sizes
    lead = (ins[0].shape, outs[0].shape)  # (T, B, ...) both, T not the batch
    return n if all(s[1] == n and s[0] != n for s in lead) else 0
