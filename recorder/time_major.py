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
>>> lstm = torch.zeros(1, 4, 16)  # (layers, B, H)
>>> carried_batch([x, lstm, mem], [torch.zeros(7, 4, 5), lstm + 1, mem + 1], rnn=True)
4
"""

from __future__ import annotations

import torch


def carried_batch(inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                  rnn: bool = False) -> int:
    """The batch size of a time-major loop carrying its state (above), else 0: the first
    input's dim 1, when its dim 0 differs, the first output holds it the same way, and every
    state passed in and returned holds it at dim 0 (or, in a model holding an ``nn.LSTM``
    (``rnn``), at dim 1 of a 3-D state: the controller's ``(layers, B, H)`` beside a DNC's
    memory ``(B, N, W)``)."""
    ins = [t for t in inputs if t.dim() and not t.is_nested]
    outs = [t for t in outputs if t.dim() and not t.is_nested]
    if len(ins) < 2 or len(outs) < 2 or ins[0].dim() < 2 or outs[0].dim() < 2:
        return 0
    n = ins[0].shape[1]
    returned = {tuple(t.shape) for t in outs[1:]}
    states = [t.shape for t in ins[1:] if tuple(t.shape) in returned]
    lead = (ins[0].shape, outs[0].shape)  # (T, B, ...) both, T not the batch
    held = all(s[0] == n or rnn and len(s) == 3 and s[1] == n for s in states)
    return n if states and held and all(s[1] == n and s[0] != n for s in lead) else 0


def time_major_inputs(inputs: list[torch.Tensor], size: int) -> bool:
    """The root inputs take the batch of ``size`` samples time-major with no module saying so:
    ``(T, B, F)`` through ``nn.Linear``s and a pooling over dim 0 (a loss target and a pooled
    output ``(B, C)`` gave the size). The first input holds ``size`` at dim 1 only (its dim 0,
    where 2-D, no multiple of it: no flattened ``(B * T, F)``) and no input holds it at dim 0
    (a few-shot episode's support set ``(N, C, H, W)`` beside its query ``(B, C, H, W)``).

    >>> time_major_inputs([torch.zeros(7, 4, 5), torch.zeros(7, 4)], 4)
    True
    >>> time_major_inputs([torch.zeros(7, 3, 5, 5), torch.zeros(3, 3, 5, 5)], 3)
    False
    """
    ins = [t for t in inputs if t.dim() > 1 and not t.is_nested]
    if not size or not ins or ins[0].shape[1] != size or \
            ins[0].shape[0] % size == 0 and ins[0].dim() < 3:  # ((T, B, F) of T = 2B)
        return False
    return all(t.shape[0] != size for t in inputs if t.dim() and not t.is_nested)
