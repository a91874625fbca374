"""A pole exactly at the self-edges of a neighbour list: each atom paired with itself.

Message passing over a graph batch takes an edge list from the data pipeline,
``edge_index (2, E)`` of (sender, receiver) node ids (PyG's, SchNetPack's ``_idx_j``/
``_idx_i``). An image search over periodic shifts that keeps the zero shift, or a
``radius_graph(loop=True)``, leaves an edge from each atom to itself: its vector is 0, its
length 0, and a radial basis ``sin(w r) / r`` or a unit vector ``vec / r`` is 0/0 there. The
cause said to add an eps or skip the rows; but the rows are edges that should not exist, and
an eps would give each atom a message from itself. :func:`self_edge_hint` says so when the
op's non-finite rows are exactly the edges of an integer root input, (2, E) or (E, 2), or of
two vectors of E ids (SchNetPack's ``_idx_i``, ``_idx_j``), whose two ids are equal, and none
other: drop them where the list is built. Where instead the two ends are different nodes whose
positions (a float root input, ``(N, 3)``) are equal there, it names the duplicated nodes.
"""

from __future__ import annotations

import torch

from recorder.capture import batch_path

from .load import Step
from .recorded import n_args


def self_edge_hint(hint: str | None, cause: str | None, hit, step: Step, mb: int) -> str | None:
    """``hint`` with the self-edges of an edge-list root input named, for an ``invalid`` op
    whose non-finite rows are exactly those edges."""
    ev = None if hit is None else hit.evidence
    if hint is None or cause != "invalid" or ev is None or ev.bad.dim() < 1 \
            or mb >= len(step.micro_batches) or not bool(ev.bad.any()):
        return hint
    rows = ev.bad.reshape(ev.bad.shape[0], -1).any(1).cpu()
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    named = [(batch_path(raw, count), step.tensors.get(key))
             for key, raw in (entry.get("paths") or {}).items()]
    lists = [(name, ends) for name, t in named if (ends := _ends(t, len(rows))) is not None]
    for name, (a, b) in lists:
        if bool((a == b).eq(rows).all()):
            return hint + _said(f"the edge list {name}", f"{name}[:, {name}[0] != {name}[1]]")
    # (the two ends as two vectors of E ids: SchNetPack's _idx_i and _idx_j)
    ids = [(name, t.cpu()) for name, t in named if _ids(t, len(rows))]
    for k, (a, ta) in enumerate(ids):
        for b, tb in ids[k + 1:]:
            if bool((ta == tb).eq(rows).all()):
                return hint + _said(f"the edge ends {a} and {b}", f"keep = {a} != {b}")
            lists.append((f"{a} and {b}", (ta, tb)))
    return _coincident(hint, rows, lists, named)


def _coincident(hint: str, rows: torch.Tensor, lists, named) -> str:
    """``hint`` with the node positions named whose rows are equal at the two ends of exactly
    the op's non-finite edges: two nodes at one place (a duplicated atom)."""
    for edges, (a, b) in lists:
        for name, t in named:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 \
                    and t.shape[0] > int(max(a.max(), b.max())) and t.shape[1] <= 3:
                x = t.detach().cpu()
                if bool(((x[a] == x[b]).all(-1) & (a != b)).eq(rows).all()):
                    return (f"{hint}; but its rows are exactly the edges ({edges}) between two "
                            f"different nodes at one position in {name} (an atom written "
                            "twice, by a format conversion or a merge of frames), no place "
                            "for an eps: remove the duplicated nodes where the data is made")
    return hint


def _said(edges: str, keep: str) -> str:
    return (f"; but its rows are exactly the self-edges of {edges}, whose two node ids are "
            "equal there (each atom paired with itself: an image search over periodic shifts "
            "that kept the zero shift, radius_graph(loop=True)), no degenerate record and no "
            f"place for an eps: drop them where the list is built ({keep})")


def _ids(t, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == n and n >= 2 \
        and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _ends(t, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two id rows of an integer edge list of ``n`` edges, (2, n) or (n, 2)."""
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() \
            or t.dtype == torch.bool or t.dim() != 2 or n < 2:
        return None
    if t.shape == (2, n):
        return t[0].cpu(), t[1].cpu()
    if t.shape == (n, 2):
        return t[:, 0].cpu(), t[:, 1].cpu()
    return None
