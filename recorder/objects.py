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

import collections
import collections.abc
import copy
import dataclasses
import functools
import json
import sys
from typing import Any

from .validate import SCRIPT_MODULES, script_module


class UnrebuildableLeaf(ValueError):
    """A batch leaf that was saved as its repr only (an arbitrary Python object)."""


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
    if module in SCRIPT_MODULES:
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


# ---------------------------------------------------------------------------------------------
# Keyed batch objects: a library's batch type that keeps its tensors in a store of its own,
# which ``to_dict()`` gives and the class's ``from_dict()`` rebuilds (PyTorch Geometric's
# ``Data``, and the ``DataBatch`` its ``DataLoader`` makes at run time of ``Batch`` and ``Data``)


def is_keyed(o: Any) -> bool:
    """``o`` is an instance (no class, no dict, no dataclass) whose type has both a
    ``to_dict`` method and a ``from_dict`` class method."""
    cls = type(o)
    return callable(getattr(cls, "from_dict", None)) and callable(getattr(cls, "to_dict", None)) \
        and not isinstance(o, (type, dict)) and not is_instance(o)


def described(o: Any) -> tuple[str, Any, list[tuple[str, Any]]] | None:
    """How a bundle records ``o``: ``("$dataclass", its type's name, its fields)``,
    ``("$keyed", its type's names, its keys)`` (:func:`is_keyed`), or None for anything else."""
    if is_instance(o):
        return "$dataclass", type_name(o), fields_of(o)
    if is_keyed(o):
        return "$keyed", keyed_type(o), keyed_items(o)
    if is_mapping(o):
        return "$mapping", type_name(o), mapping_items(o)
    return None


# ---------------------------------------------------------------------------------------------
# Mappings that are no dict: ``collections.UserDict`` and its subclasses (transformers'
# ``BatchEncoding``, what a tokenizer returns and sentence-transformers passes whole to its
# model, whose modules write their outputs into it), a ``collections.abc.Mapping`` of the user's


def member(tag: str, key: str) -> str:
    """How a report writes the field or key ``key`` of an object :func:`described` as ``tag``:
    ``["input_ids"]`` of a mapping (a ``BatchEncoding``), ``.values`` of the others."""
    return f"[{json.dumps(key)}]" if tag in ("$mapping", "$tensordict") else f".{key}"


def is_mapping(o: Any) -> bool:
    """``o`` is a mapping that is no ``dict`` (a dict subclass is walked as a dict)."""
    return isinstance(o, collections.abc.Mapping) and not isinstance(o, (dict, type))


def mapping_items(o: Any) -> list[tuple[str, Any]]:
    """``(key, value)`` of the mapping ``o``, string keys only."""
    return [(k, v) for k, v in o.items() if isinstance(k, str)]


def mapped(o: Any, values: dict[str, Any]) -> Any:
    """A copy of the mapping ``o`` holding ``values``: a ``UserDict`` copied with its other
    attributes (a ``BatchEncoding``'s encodings), another type built from the dict; ``o``
    itself when its type refuses one."""
    if isinstance(o, collections.UserDict):
        new = copy.copy(o)  # (UserDict.__copy__: a new .data, the other attributes shared)
        new.data = dict(values)
        return new
    try:
        return type(o)(values)
    except Exception:  # (a user's mapping with another constructor)
        return o


def rebuild_mapping(name: str, values: dict[str, Any]) -> Any:
    """The mapping recorded as ``name`` (``module:qualname``, a type already imported) built
    from ``values``; a plain dict when that type is not at hand or refuses them."""
    cls = imported(name)
    if isinstance(cls, type) and issubclass(cls, collections.abc.Mapping):
        try:
            return cls(values)
        except Exception:  # (a constructor that takes no dict)
            pass
    return dict(values)


def keyed_items(o: Any) -> list[tuple[str, Any]]:
    """``(key, value)`` of ``o.to_dict()``, string keys only (an object whose ``to_dict`` fails
    or gives no dict has none)."""
    try:
        d = o.to_dict()
    except Exception:  # (a library's own method: it may refuse a partial object)
        return []
    return [(k, v) for k, v in d.items() if isinstance(k, str)] if isinstance(d, dict) else []


def keyed_type(o: Any) -> list[str]:
    """The names (``module:qualname``) to rebuild ``o``'s type from: its own when its module
    holds it under that name, else its direct bases' (a class made at run time: PyG's
    ``DataBatch``, of ``Batch`` and ``Data``)."""
    cls = type(o)
    if imported(type_name(o)) is cls:
        return [type_name(o)]
    return [f"{b.__module__}:{b.__qualname__}" for b in cls.__bases__]


def rebuild_keyed(names: list[str], values: dict[str, Any]) -> Any:
    """An instance of the type recorded as ``names`` (:func:`keyed_type`) made by its
    ``from_dict(values)``: the one class, or a class of those bases (made once per names) when
    every one of them is already imported. None when a name is not at hand or the class
    refuses the values: the caller rebuilds a stand-in."""
    cls = _keyed_class(tuple(names))
    if cls is None:
        return None
    try:
        return cls.from_dict(dict(values))
    except Exception:  # (the library's own check of the values)
        return None


@functools.lru_cache(maxsize=64)
def _keyed_class(names: tuple[str, ...]) -> type | None:
    bases = [imported(n) for n in names]
    if not bases or not all(isinstance(b, type) for b in bases):
        return None
    if len(bases) == 1:
        cls = bases[0]
    else:
        metas = tuple(dict.fromkeys(type(b) for b in bases))  # (Batch's and Data's ABCMeta)
        name = bases[0].__name__ if bases[0].__name__.isidentifier() else "RecordedBatch"
        try:
            meta = metas[0] if len(metas) == 1 else type("RecordedMeta", metas, {})
            cls = meta(name, tuple(bases), {})
        except TypeError:  # (an impossible order of bases, a metaclass that refuses)
            return None
    return cls if callable(getattr(cls, "from_dict", None)) else None


def imported(name: str) -> Any:
    """What ``module:qualname`` names among the modules already imported (no import, no module
    ``__getattr__``), or None."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, "__dict__", {}).get(part)
    return found
