"""Dataclass instances in batches (a ``collate_fn`` returning ``Batch(values=..., mask=...)``,
passed whole to the model): walked field by field like a dict, so their tensors are checked,
stored and named (``batch.values``), and rebuilt by the replay as their own type when the
module that defines it is already imported (the factory's), else as a stand-in dataclass with
the same fields, which a ``forward`` reading ``batch.values`` cannot tell apart.

>>> is_instance(Batch(x, m)), fields_of(Batch(x, m))          # doctest: +SKIP
(True, [('values', x), ('mask', m)])
>>> rebuild("train:Batch", {"values": x, "mask": m})         # doctest: +SKIP
Batch(values=..., mask=...)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from typing import Any

from .validate import script_module


def is_instance(o: Any) -> bool:
    """``o`` is an instance of a dataclass (not the class itself)."""
    return dataclasses.is_dataclass(o) and not isinstance(o, type)


def fields_of(o: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of every field of the dataclass instance ``o``."""
    return [(f.name, getattr(o, f.name)) for f in dataclasses.fields(o)]


def type_name(o: Any) -> str:
    """``module:qualname`` of ``o``'s type; a class of the training script (``__main__``) is
    named by the module the replay imports that script as (``train:Batch``), as a factory or a
    loss defined there is."""
    cls = type(o)
    module = cls.__module__
    if module == "__main__":
        module = script_module() or module
    return f"{module}:{cls.__qualname__}"


def replaced(o: Any, values: dict[str, Any]) -> Any:
    """A shallow copy of ``o`` with the fields in ``values`` set, without running its
    ``__init__`` or ``__post_init__`` (which may move or check tensors), frozen or not."""
    new = copy.copy(o)
    for k, v in values.items():
        object.__setattr__(new, k, v)
    return new


def rebuild(name: str, values: dict[str, Any]) -> Any:
    """An instance of the type recorded as ``name`` (see :func:`_type`) holding ``values``,
    made without calling its ``__init__``, as :func:`replaced` does."""
    cls = _type(name, tuple(values))
    obj = cls.__new__(cls)
    for k, v in values.items():
        object.__setattr__(obj, k, v)
    return obj


def _type(name: str, fields: tuple[str, ...]) -> type:
    """That dataclass when its module is already imported and defines it with these fields;
    else a stand-in. Imports nothing and runs no module ``__getattr__``: a bundle's names are
    data, they choose no code to run."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, "__dict__", {}).get(part)
    if (isinstance(found, type) and dataclasses.is_dataclass(found)
            and tuple(f.name for f in dataclasses.fields(found)) == fields):
        return found
    return _stand_in(qualname.rpartition(".")[2], fields)


@functools.lru_cache(maxsize=64)
def _stand_in(name: str, fields: tuple[str, ...]) -> type:
    """A dataclass of that name and fields (one per name and fields)."""
    return dataclasses.make_dataclass(name if name.isidentifier() else "RecordedBatch", fields)
