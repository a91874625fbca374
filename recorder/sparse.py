"""Sparse and nested tensors in a batch (a graph's adjacency passed to ``forward``, as Kipf's
pygcn does; point clouds of different sizes as one nested tensor): a bundle holds dense
tensors only, so a sparse COO or CSR tensor is written as the dense tensors it is made of, a
nested one as its components padded into one tensor, and each is rebuilt from them (see
``docs/bundle-format.md``)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .compat import sparse_indices, sparse_values

SPARSE = (torch.sparse_coo, torch.sparse_csr)


def sparse_node(t: torch.Tensor, path: str, put) -> dict[str, Any]:
    """A sparse COO or CSR tensor (a graph's adjacency passed to ``forward``) as the dense
    tensors it is made of, which a bundle can hold; ``put(tensor, path)`` stores each."""
    if t.layout == torch.sparse_coo:
        return {"$sparse": "coo", "size": list(t.shape), "coalesced": t.is_coalesced(),
                "indices": put(sparse_indices(t), f"{path}.indices"),
                "values": put(sparse_values(t), path)}
    return {"$sparse": "csr", "size": list(t.shape),
            "crow": put(t.crow_indices(), f"{path}.crow_indices"),
            "col": put(t.col_indices(), f"{path}.col_indices"), "values": put(t.values(), path)}


def rebuild_sparse(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sparse tensor :func:`sparse_node` described."""
    def get(name: str) -> torch.Tensor:
        return tensors[node[name]["$t"]]

    # check_invariants: a bundle's indices are read from a file, so out-of-range ones raise
    # here rather than crash a kernel later; saying so also keeps torch from warning, on the
    # replay's stderr, that the checks are "implicitly disabled"
    if node["$sparse"] == "coo":
        return torch.sparse_coo_tensor(get("indices"), get("values"), node["size"],
                                       is_coalesced=bool(node.get("coalesced")),
                                       check_invariants=True)
    with warnings.catch_warnings():  # (torch's "CSR support is in beta state", once)
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse_csr_tensor(get("crow"), get("col"), get("values"), node["size"],
                                       check_invariants=True)


def nested_node(t: torch.Tensor, path: str, put) -> dict[str, Any]:
    """A nested tensor as its components zero-padded into one dense tensor (under the nested
    tensor's own path: its dim 0 is the components, the samples) and their shapes, one row
    each (a tensor too, so that ``--try drop=`` drops a sample's row of both)."""
    sizes = torch.tensor([list(c.shape) for c in t.unbind()], dtype=torch.int64)
    return {"$nested": put(torch.nested.to_padded_tensor(t, 0.0), path),
            "sizes": put(sizes, f"{path}.sizes"),
            "layout": "jagged" if t.layout == torch.jagged else "strided"}


def rebuild_nested(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The nested tensor :func:`nested_node` described."""
    padded = tensors[node["$nested"]["$t"]]
    parts = [padded[i][tuple(slice(0, n) for n in size)]
             for i, size in enumerate(tensors[node["sizes"]["$t"]].tolist())]
    layout = torch.jagged if node.get("layout") == "jagged" else torch.strided
    return torch.nested.nested_tensor(parts, layout=layout)
