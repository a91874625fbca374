"""TensorDict and ``@tensorclass`` batches (the ``tensordict`` library: torchrl's rollouts, a
``collate_fn`` returning ``TensorDict(..., batch_size=[B])``), passed whole to the model
(``TensorDictModule``, ``TensorDictSequential``, or ``td["obs", "pixels"]`` in a forward).

They were walked as PyG-style keyed objects and dataclasses: the replay rebuilt a TensorDict
with ``batch_size=[]`` and a tensorclass with no ``_tensordict`` (every read raised). Here they
are walked key by key (a TensorDict: ``batch["obs"]["pixels"]``) or field by field (a
tensorclass: ``batch.obs``), stored with their batch size, and rebuilt as their own type. A
copy of one (the root call's, before ``TensorDictModule`` writes its outputs into it) is made
by its own ``apply``, which keeps the batch size and copies the nested TensorDicts too.

Nothing here imports ``tensordict`` while recording: a run that never imported it holds none.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

from .objects import UnrebuildableLeaf, imported, rebuild, type_name

DICT, CLASS = "$tensordict", "$tensorclass"
TAGS = (DICT, CLASS)


def is_collection(o: Any) -> bool:
    """``o`` is a TensorDict (any ``TensorDictBase``) or a tensorclass instance."""
    lib = sys.modules.get("tensordict")
    return lib is not None and not isinstance(o, type) and lib.is_tensor_collection(o)


def described(o: Any) -> tuple[str, str, list[tuple[str, Any]], tuple[str, list[int]]] | None:
    """``(tag, type name, items, ("$batch_size", its batch size))`` of a collection, None for
    anything else: a tensorclass's fields, a TensorDict's string keys one level down (a nested
    TensorDict is an item)."""
    if not is_collection(o):
        return None
    size = ("$batch_size", list(o.batch_size))
    if dataclasses.is_dataclass(o):
        return CLASS, type_name(o), [(f.name, getattr(o, f.name))
                                     for f in dataclasses.fields(o)], size
    return DICT, type_name(o), [(k, o[k]) for k in o.keys() if isinstance(k, str)], size


def mapped(o: Any, fn) -> Any:
    """A copy of the collection ``o`` with ``fn`` applied to each tensor, its batch size kept."""
    return o.apply(fn)


def tag_of(node: dict[str, Any]) -> str | None:
    """The tag of a bundle's node for a collection, None for any other node."""
    return DICT if DICT in node else CLASS if CLASS in node else None


def rebuilt(node: dict[str, Any], name: str, values: dict[str, Any]) -> Any:
    """The collection recorded as ``node`` (type ``name``) holding ``values`` with its batch
    size; where the tensors no longer lead with it (a ``--try drop=`` re-run left rows out),
    the size is taken from them, as many dims as recorded. A type already imported is called
    only when it is a tensorclass or a TensorDict type; a tensorclass not at hand is a stand-in
    dataclass with its fields, any other TensorDict type ``tensordict``'s own."""
    tag, size = tag_of(node), node.get("$batch_size")
    if not (isinstance(size, list) and all(type(n) is int and n >= 0 for n in size)):
        raise UnrebuildableLeaf(f"{name[:100]} with batch size {str(size)[:50]}")
    lib, cls = _library(), imported(name)
    if tag == CLASS:
        if lib is None or not (isinstance(cls, type) and lib.is_tensorclass(cls)):
            return rebuild(name, values)
        return _sized(lambda bs: cls(**values, batch_size=bs), values, size)
    if lib is None:
        raise UnrebuildableLeaf(f"TensorDict {name[:100]}: the batch was a TensorDict and "
                                "tensordict is not installed here; pip install tensordict")
    if not (isinstance(cls, type) and issubclass(cls, lib.TensorDict)):
        cls = lib.TensorDict
    return _sized(lambda bs: cls(values, batch_size=bs), values, size)


def _sized(make, values: dict[str, Any], size: list[int]) -> Any:
    try:
        return make(size)
    except RuntimeError:  # (the batch size the tensors' shapes refuse: rows dropped)
        return make(_leading(values, len(size)))


def _leading(values: dict[str, Any], dims: int) -> list[int]:
    """The first ``dims`` sizes of the first tensor among ``values``."""
    for v in values.values():
        shape = getattr(v, "shape", None)
        if shape is not None and len(shape) >= dims:
            return list(shape[:dims])
    return []


def _library() -> Any:
    """The ``tensordict`` module, imported by that fixed name (a bundle names no module to
    import), or None when it is not installed."""
    try:
        return importlib.import_module("tensordict")
    except ImportError:
        return None
