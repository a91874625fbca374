"""The loss's arguments that are the model's own inputs: a validity mask a loop gives to
``forward`` and to the loss alike (``model(face, person, valid)``, then
``loss(out, gaze, valid)``) is stored once, as a model input; the loss's tree holds a
reference to it (``{"$in": key}``) and no ``loss_paths`` entry. Finders over the loss's data
(a 0/1 flag of unlabelled samples) read these too, named by their place among the loss's
arguments."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from recorder.capture import loss_path

from .load import Step


def loss_input_refs(step: Step, mb: int) -> Iterator[tuple[str, str]]:
    """(readable loss-argument name, model-input tensor key) of every model input the loss
    call of micro-batch ``mb`` was given."""
    yield from _walk(step.micro_batches[mb].get("loss_inputs"), "")


def _walk(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")
    elif isinstance(node, dict):
        if isinstance(node.get("$in"), str):
            yield loss_path(path), node["$in"]
        elif "$list" in node or "$tuple" in node:
            yield from _walk(node.get("$list", node.get("$tuple")), path)
        elif isinstance(node.get("$dict"), list):
            for k, v in (kv for kv in node["$dict"] if isinstance(kv, list) and len(kv) == 2):
                yield from _walk(v, f"{path}[{json.dumps(k) if isinstance(k, str) else k}]")
