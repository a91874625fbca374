"""Weights a loop without an optimizer wrote after the step's forward read them.

Given no optimizer, the recorder closes a step at the next root forward, so the step stays
open through the loop's own update (``p -= lr * p.grad``, a float32 master copy written back
into a bfloat16 model): a NaN made by the step's forward or backward reaches the weights
before the step is checked. Such a weight is no ``weights`` event: the step's statistics show
that its module's calls returned finite values, which a NaN or infinite weight does not allow.
Slow path only (the decoded calls of the failing step).
"""

from __future__ import annotations

from typing import Any


def written_after_forward(bad: list[int], param_names: list[str], module_names: list[str],
                          calls: list[dict[str, Any]]) -> list[int]:
    """The parameters among ``bad`` (indices into ``param_names``) whose owning module was
    called in the step, every call returning finite values."""
    index = {name: i for i, name in enumerate(module_names)}
    out = []
    for i in bad:
        owner = index.get(param_names[i].rpartition(".")[0])
        mine = [d for d in calls if d["module"] == owner]
        if owner is not None and mine and not any(d["nan"] or d["posinf"] or d["neginf"]
                                                  for d in mine):
            out.append(i)
    return out
