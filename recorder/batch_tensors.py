"""The tensors of a recorded batch an event reads on the host: the first one holding a
non-finite value (the model's input at an input event), and those of a model output, a
distribution's among them (see :mod:`recorder.events`)."""

from __future__ import annotations

from typing import Any

import torch

from .capture import flatten_tree, object_tensors
from .finite import finite, has_nan, kind_of
from .graph_reach import from_model
from .samples import Record, Samples, packed_in


def first_bad_tensor(obj: Any, samples: Samples, skip=(), nan_only: bool = False,
                      model=None) -> tuple[str, list[int], str] | None:
    """(path, samples, kind) of the first data tensor in ``obj`` holding a non-finite
    value; with ``model`` (its outputs and parameters), a tensor with a graph that does not
    reach them (another network's output) counts as data too."""
    _, tensors, paths = flatten_tree(obj, "x")
    for key, t in tensors.items():
        if any(t is s for s in skip) or (t.grad_fn is not None
                                         and (model is None or from_model(t, *model))):
            continue  # the model output, or computed from it: not data
        if nan_only and not has_nan(t):
            continue
        if not finite(t):
            packed = packed_in(obj, samples.targets)
            rows = samples.rows(t, packed)
            if isinstance(packed.get(id(t)), Record):  # (its list's other samples too)
                rows = record_rows(tensors.values(), packed, samples, packed[id(t)].of, rows)
            return paths[key], rows, kind_of(t)
    return None


def record_rows(tensors, packed, samples: Samples, of: int, rows: list[int]) -> list[int]:
    """The samples of a list of per-sample entries (a model taking a list of clips of
    different lengths) whose entries hold a non-finite value: each entry is its own
    tensor, so the first one found names one sample of several."""
    more = {r for t in tensors if isinstance(rec := packed.get(id(t)), Record)
            and rec.of == of and not finite(t) for r in samples.rows(t, packed)}
    return sorted(set(rows) | more)


def data_tensors(obj):
    _, tensors, _ = flatten_tree(obj, "x")
    return tensors.values()


def output_tensors(obj):
    """A model output's tensors, then those of its distributions (a forecaster's ``Normal``),
    a distribution's logits with their intended +-inf (masked classes) read as finite."""
    inf_ok: set[int] = set()
    dists = list(object_tensors(obj, inf_ok=inf_ok))
    return [*data_tensors(obj), *(t.masked_fill(torch.isinf(t), 0.0) if id(t) in inf_ok else t
                              for t in dists)]
