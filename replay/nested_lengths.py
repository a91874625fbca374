"""The lengths of a nested batch's components (a jagged batch of sequences,
``torch.nested.nested_tensor(seqs, layout=torch.jagged)``): a bundle keeps a nested tensor as
its padded components and their sizes, one row each (``recorder.sparse``), so a sequence of
length 0 shows as a size of 0 in its row. Given as one count per sample, the empty-records
hint names such a sequence as a record of length 0, as it does a collate_fn's lengths."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from recorder.capture import batch_path

from .load import Step
from .recorded import n_args


def nested_lengths(step: Step, mb: int) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, sizes, 0) of each dim along which the components of a nested tensor among the
    micro-batch's model inputs differ in size (a jagged batch's sequence lengths)."""
    if mb >= len(step.micro_batches):
        return
    entry = step.micro_batches[mb]
    paths, count = entry.get("paths") or {}, n_args(entry.get("inputs"))
    for node in _nested_nodes(entry.get("inputs")):
        sizes = step.tensors.get(node["sizes"].get("$t"))
        raw = paths.get(node["$nested"].get("$t"))
        if not isinstance(sizes, torch.Tensor) or sizes.dim() != 2 or raw is None:
            continue
        for dim in range(sizes.shape[1]):
            if bool((sizes[:, dim] != sizes[0, dim]).any()):
                yield f"the lengths of {batch_path(raw, count)}", sizes[:, dim], 0


def _nested_nodes(tree: Any) -> Iterator[dict[str, Any]]:
    """The nested-tensor nodes of a recorded batch's JSON tree."""
    if isinstance(tree, dict):
        if isinstance(tree.get("$nested"), dict) and isinstance(tree.get("sizes"), dict):
            yield tree
            return
        tree = list(tree.values())
    if isinstance(tree, list):
        for v in tree:
            yield from _nested_nodes(v)
