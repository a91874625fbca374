"""The graphs of a graph batch's edge rows, through its edge list.

A graph batch names each node's graph in its assignment vector (:class:`~recorder.samples.
Segments`); a tensor per edge (bond lengths ``(E,)``, their Gaussian expansion ``(E, K)``, a
message per edge) has as many rows as the edge list ``(2, E)`` of node ids has columns, and
each of its rows lies in the graph of the edge's nodes. A value an op made non-finite on the
bonds of one crystal names that crystal, not the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def edge_graphs(tensors: Iterable[torch.Tensor], ids: torch.Tensor) -> torch.Tensor | None:
    """The graph of each column of the first edge list among ``tensors``: an integer ``(2, E)``
    tensor of node ids (``0 <= id < N``, ``N`` the nodes ``ids`` assigns) whose two ends of
    every edge lie in one graph, with ``E != N`` (a node tensor is no edge list); None when
    there is none (host reads: the event's slow path)."""
    n = ids.numel()
    owner = ids.detach().cpu().long()
    for t in tensors:
        if t.dim() != 2 or t.shape[0] != 2 or t.dtype not in (torch.int64, torch.int32) \
                or t.shape[1] in (0, n):
            continue
        v = t.detach().cpu().long()
        if int(v.min()) < 0 or int(v.max()) >= n:
            continue
        graphs = owner[v[0]]
        if bool((graphs == owner[v[1]]).all()):
            return graphs
    return None


def edge_samples(graphs: torch.Tensor, rows: list[int]) -> list[int]:
    """The graphs of edge rows ``rows``."""
    return sorted(set(graphs[torch.tensor(rows, dtype=torch.long)].tolist())) if rows else []
