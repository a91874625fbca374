"""``--try drop=`` of a sparse input over the samples (a graph's ``(N, N)`` adjacency, the
samples its nodes; COO or CSR, as :mod:`recorder.sparse` records them): its entries in the
rows kept, and in the columns kept when it is square, renumbered to them."""

from __future__ import annotations

import torch


def drop_sparse(tensors: dict[str, torch.Tensor], tree, n: int, keep: torch.Tensor,
                cut: list[str]):
    """``tree`` with each sparse input of ``n`` rows cut to the rows ``keep`` (and columns,
    when square): its parts' new values in ``tensors`` (their keys added to ``cut``), and its
    node a copy with the new size."""
    if isinstance(tree, list):
        return [drop_sparse(tensors, v, n, keep, cut) for v in tree]
    if not isinstance(tree, dict):
        return tree
    size = tree.get("size") or [None]
    if tree.get("$sparse") not in ("coo", "csr") or size[0] != n \
            or (tree["$sparse"] == "csr" and len(size) != 2):  # (a batched CSR: no node rows)
        return {k: drop_sparse(tensors, v, n, keep, cut) for k, v in tree.items()}
    square = len(size) == 2 and size[1] == n
    rows, cols, vk = _entries(tensors, tree)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[keep] = True
    renumber = torch.cumsum(kept, 0) - 1
    on = kept[rows] & (kept[cols] if square else True)
    rows, cols = renumber[rows[on]], cols[on]
    cols = renumber[cols] if square else cols
    tensors[vk] = tensors[vk][on.to(tensors[vk].device)]
    new = [len(keep), len(keep) if square else size[1], *size[2:]]
    if tree["$sparse"] == "coo":
        ik = tree["indices"]["$t"]
        idx = tensors[ik].cpu()[:, on].clone()
        idx[0] = rows
        if square:
            idx[1] = cols
        tensors[ik] = idx.to(tensors[ik].device)
        cut += [ik, vk]
    else:  # (entries stay in row order, columns sorted within each: renumbering keeps both)
        ck, lk = tree["crow"]["$t"], tree["col"]["$t"]
        counts = torch.bincount(rows, minlength=len(keep))
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        tensors[ck] = crow.to(tensors[ck].device, tensors[ck].dtype)
        tensors[lk] = cols.to(tensors[lk].device, tensors[lk].dtype)
        cut += [ck, lk, vk]
    return {**tree, "size": new}


def _entries(tensors: dict[str, torch.Tensor], node: dict):
    """The row and column of each stored entry (on the host), and the values' key."""
    vk = node["values"]["$t"]
    if node["$sparse"] == "coo":
        idx = tensors[node["indices"]["$t"]].cpu()
        return idx[0], idx[1], vk
    crow = tensors[node["crow"]["$t"]].cpu().long()
    rows = torch.repeat_interleave(torch.arange(crow.numel() - 1), crow.diff())
    return rows, tensors[node["col"]["$t"]].cpu().long(), vk
