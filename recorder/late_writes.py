"""Weights the loop wrote after the step's forward read them.

Given no optimizer, the recorder closes a step when the backward that writes its gradients
ends; a step with no such backward (an update from ``torch.autograd.grad``'s gradients, a
server's ``load_state_dict`` between evaluations) stays open until the next root forward,
through the loop's own writes; with one, a loop may still write the weights between a step's
forwards (SAM's ``w + e`` from the first backward's gradients). Either way a NaN made by the
step's forward or backward reaches the weights before the step is checked. Such a weight is no
``weights`` event: the step's statistics show that its module's calls returned finite values,
which a NaN or infinite weight does not allow. Slow path only.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import version_of
from .tape import Tape


def moved_in_step(tape: Tape, watched: torch.Tensor | None) -> bool:
    """The watched weight (one the recorded optimizer holds) moved in place while ``tape``'s
    step was open, outside the recorded ``step()``: the loop wrote the weights in the step."""
    return watched is not None and tape.held_version is not None \
        and version_of(watched) != tape.held_version


def written_after_forward(bad: list[int], param_names: list[str], module_names: list[str],
                          calls: list[dict[str, Any]]) -> list[int]:
    """The parameters among ``bad`` (indices into ``param_names``) whose owning module's first
    call in the step (``calls`` in completion order) does not show them bad: it returned finite
    values, or its inputs already held the non-finite value that came out (made upstream, by
    a call whose own weights, if bad, show it). A later forward of the step may have used
    them after the write."""
    firsts = _first_calls(bad, param_names, module_names, calls)
    return [i for i, first in zip(bad, firsts) if first is not None and (
        not first["inputs_finite"] or not (first["nan"] or first["posinf"] or first["neginf"]))]


def read_finite(late: list[int], param_names: list[str], module_names: list[str],
                calls: list[dict[str, Any]]) -> list[int]:
    """Of ``late``, the parameters whose module's first call took finite inputs and returned
    finite values: they were finite when read. The others' calls took the non-finite value
    from upstream, which says nothing of their own weights: beside weights that were bad as
    the step began (a FedAvg server's load of an average a client poisoned), they may have
    been bad as well."""
    firsts = _first_calls(late, param_names, module_names, calls)
    return [i for i, first in zip(late, firsts) if first is not None and first["inputs_finite"]]


def _first_calls(params: list[int], param_names: list[str], module_names: list[str],
                 calls: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Each parameter's owning module's first call in the step (None: no such call)."""
    index = {name: i for i, name in enumerate(module_names)}
    out = []
    for i in params:
        owner = index.get(param_names[i].rpartition(".")[0])
        out.append(None if owner is None else
                   next((d for d in calls if d["module"] == owner), None))
    return out
