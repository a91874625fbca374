"""What a step needs to be re-run: RNG states, nested batches as (JSON tree, tensors), environment.

Everything here is plain data: trees become JSON with tensor leaves named by key, so a bundle
never needs pickle to say what the batch looked like.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
import keyword
import math
import os
import platform
import random
import subprocess
import sys
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from . import objects
from .sparse import SPARSE, nested_node, rebuild_nested, rebuild_sparse, sparse_node

# ---------------------------------------------------------------------------------------------
# RNG states


class RngCapture:
    """Captures every RNG a training step may draw from (see :meth:`__call__`).

    ``random.getstate()`` (a 625-tuple, ~9 us) and NumPy's ``get_state()`` (~30 us) are a large
    share of a small step, so each is re-read only when a fingerprint of the generator's raw
    MT19937 words (position and three key words) and its cached gaussian has moved since the
    last read. Every draw moves the position or the cached gaussian and every wrap regenerates
    the words, so an unchanged fingerprint means an unchanged state. The words are read in
    place: NumPy's through its documented ``ctypes`` interface (its cached gaussian inside the
    ``RandomState`` object), CPython's at the ``RandomObject`` layout, each used only after it
    is checked against the real state at the first capture.
    """

    def __init__(self):
        # the generator (and RandomState) whose memory is read is held, so it can never
        # dangle; one replaced by another is looked at afresh
        self._np_owner = self._np_rs = self._np_words = self._np_gauss = None
        self._np_last: tuple | None = None
        self._np_key: tuple | None = None
        self._py_owner = self._py_words = None
        self._py_last: tuple | None = None
        self._py_key: tuple | None = None

    def _numpy_state(self, np) -> Any:
        # the generator behind np.random's functions (bound to it when NumPy was imported)
        rs = getattr(np.random.get_state, "__self__", None)
        owner = getattr(rs, "_bit_generator", None)
        if owner is not self._np_owner or rs is not self._np_rs:  # (the gauss cells are rs's)
            self._np_owner, self._np_rs, self._np_last = owner, rs, None
            try:
                addr = owner.ctypes.state_address
                self._np_words = _uint32s((ctypes.c_uint32 * 625).from_address(addr))
                cells = _numpy_gauss_cells(rs, addr)
                self._np_gauss = cells and (_cell(cells[0], "i"), _cell(cells[1], "d"))
            except Exception:
                self._np_words = False
        words, gauss = self._np_words, self._np_gauss
        if words is False or gauss is False:
            return np.random.get_state()
        # A legacy gaussian draw leaves its second value cached (``has_gauss``, ``gauss``) and
        # the next one uses it without moving the words: both are part of the key.
        key = (words[624], words[0], words[311], words[623], gauss[0][0], gauss[1][0])
        if key != self._np_key or self._np_last is None:
            self._np_last, self._np_key = np.random.get_state(), key
        return self._np_last

    def _python_state(self) -> tuple:
        inst = random.getstate.__self__  # the instance behind random's functions
        if inst is not self._py_owner:
            self._py_owner, self._py_last = inst, None
            words = _python_mt_words(inst)
            self._py_words = words and _uint32s(words)
        words = self._py_words
        if words is False:
            return random.getstate()
        # gauss() keeps a second value outside the words: part of the state too
        key = (words[0], words[1], words[312], words[624], inst.gauss_next)
        if key != self._py_key or self._py_last is None:
            self._py_last, self._py_key = random.getstate(), key
        return self._py_last

    def __call__(self) -> dict[str, Any]:
        """Every RNG a training step may draw from, as it is now. Draws nothing itself."""
        state: dict[str, Any] = {"python": self._python_state(),
                                 "torch_cpu": torch.default_generator.get_state()}
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = self._numpy_state(np)
        if torch.cuda.is_initialized():  # else no CUDA generator has drawn yet
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state


def _uint32s(words) -> memoryview:
    """A ctypes ``c_uint32`` array as a memoryview: indexing it is a plain C read, where a
    ctypes index goes through ctypes' item machinery (a few us each when it runs once a step,
    its code out of the CPU's caches after the step's kernels)."""
    return memoryview(words).cast("B").cast("I")


def _cell(cell, fmt: str) -> memoryview:
    """A ctypes scalar as a one-element memoryview (see :func:`_uint32s`)."""
    return memoryview(cell).cast("B").cast(fmt)


def _numpy_gauss_cells(rs, state_address: int):
    """(``has_gauss``, ``gauss``) of NumPy's legacy ``RandomState`` as ctypes cells over the
    object itself, or False where they cannot be found. The object holds a ``bitgen_t`` whose
    first field points at the bit generator's state (``state_address``) and, after it, an
    ``aug_bitgen_t`` ``{bitgen_t *bit_generator; int has_gauss; double gauss}`` pointing back
    at that ``bitgen_t``: both pointers are looked for within the object's own size, and the
    cells are used only if they agree with ``get_state()`` now."""
    try:
        base, n = id(rs), type(rs).__basicsize__ // 8
        words = (ctypes.c_uint64 * n).from_address(base)
        bitgen = next(k for k in range(n) if words[k] == state_address)
        aug = next(k for k in range(bitgen + 1, n) if words[k] == base + 8 * bitgen)
        if 8 * aug + 24 > 8 * n:
            return False
        has = ctypes.c_int.from_address(base + 8 * aug + 8)
        cached = ctypes.c_double.from_address(base + 8 * aug + 16)
        _, _, _, has_gauss, gauss = rs.get_state()
        if has.value == has_gauss and (not has_gauss or cached.value == gauss):
            return has, cached
    except Exception:
        pass
    return False


def _python_mt_words(inst: random.Random):
    """CPython's ``RandomObject`` after its object header: ``int index; uint32 state[624]``,
    as 625 uint32 words (index first), or False where the layout is not that one (another
    interpreter or build): checked against ``getstate()``, whose tuple is the state words
    followed by the index."""
    try:
        if sys.implementation.name != "cpython" or type(inst) is not random.Random:
            return False
        header = object.__basicsize__  # refcount and type pointer
        words = (ctypes.c_uint32 * 625).from_address(id(inst) + header)
        version, internal, _ = inst.getstate()
        if version == 3 and list(internal) == [*words[1:], words[0]]:
            return words
    except Exception:
        pass
    return False


def capture_rng() -> dict[str, Any]:
    """Every RNG a training step may draw from, as it is now. Draws nothing itself."""
    return RngCapture()()


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` (or :func:`rng_from_bundle`) returned; generators it
    leaves out (see :func:`rng_drawn`) stay as they are."""
    if "python" in state:
        random.setstate(state["python"])
    if "torch_cpu" in state:
        torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        import numpy as np  # only when the recorded run used it

        np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def rng_to_bundle(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split an RNG state into JSON metadata and tensors for the bundle."""
    meta: dict[str, Any] = {}
    tensors = {"rng/torch_cpu": state["torch_cpu"].clone()} if "torch_cpu" in state else {}
    if "python" in state:
        version, internal, gauss = state["python"]
        meta["python"] = {"version": version, "gauss": gauss}
        tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        meta["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached)}
        tensors["rng/numpy"] = torch.tensor(keys.tolist(), dtype=torch.int64)
    for i, s in enumerate(state.get("cuda", [])):
        tensors[f"rng/cuda/{i}"] = s.cpu().clone()
    meta["cuda_devices"] = len(state.get("cuda", []))
    return meta, tensors


def rng_drawn(state: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The generators of ``state`` (a capture) that moved since the capture ``before``: those
    a later micro-batch's entry must restore (all of them when ``before`` is None)."""
    if before is None:
        return state
    return {k: v for k, v in state.items() if not _same_state(v, before.get(k))}


def _same_state(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):  # python (version, words, gauss), numpy's, cuda's list
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            _same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy's key array
        return a.shape == b.shape and bool((a == b).all())
    return a == b


def rng_from_bundle(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of :func:`rng_to_bundle`."""
    state: dict[str, Any] = {}
    if "python" in meta:  # (a micro-batch's states hold the generators that drew: rng_drawn)
        py = meta["python"]
        state["python"] = (py["version"], tuple(tensors["rng/python"].tolist()), py["gauss"])
    if "rng/torch_cpu" in tensors:
        state["torch_cpu"] = tensors["rng/torch_cpu"]
    if "numpy" in meta:
        import numpy as np

        npm = meta["numpy"]
        keys = np.array(tensors["rng/numpy"].tolist(), dtype=np.uint32)
        state["numpy"] = (npm["name"], keys, npm["pos"], npm["has_gauss"], npm["cached_gaussian"])
    if meta.get("cuda_devices"):
        state["cuda"] = [tensors[f"rng/cuda/{i}"] for i in range(meta["cuda_devices"])]
    return state


# ---------------------------------------------------------------------------------------------
# Nested batches <-> JSON tree + named tensors


def _json_float(x: float) -> Any:
    return x if math.isfinite(x) else {"$float": repr(x)}


def flatten_tree(obj: Any, prefix: str, leaf=None) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """Encode ``obj`` as JSON; tensor leaves are returned under keys ``prefix/<n>``.

    Also returns a readable path for each key, such as ``[0]["image"]``. Leaves that are neither
    tensors nor JSON scalars are kept as their ``repr`` and marked, so the replay can say it
    cannot rebuild them instead of guessing.
    """
    tensors: dict[str, torch.Tensor] = {}
    paths: dict[str, str] = {}

    # (not torch.utils._pytree: the bundle's paths and $list/$tuple/$dict markers name each
    # container as written, and pytree keeps dict/list subclasses it does not know as leaves)
    def put(t: torch.Tensor, path: str) -> dict[str, str]:
        key = f"{prefix}/{len(tensors)}"
        tensors[key] = t
        paths[key] = path
        return {"$t": key}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            node = leaf(o) if leaf is not None else None
            if node is not None:
                return node
            if o.layout in SPARSE:  # (its values under its own path: an event names them)
                return sparse_node(o, path, put)
            if o.is_nested:
                return nested_node(o, path, put)
            return put(o, path)
        if o is None or isinstance(o, (bool, int, str)):
            return o
        if isinstance(o, float):
            return _json_float(o)
        if namedtuple_like(o):  # (a PackedSequence) with its type, for the replay to rebuild
            cls = type(o)
            return {"$tuple": [walk(v, f"{path}.{f}") for f, v in zip(cls._fields, o)],
                    "$namedtuple": f"{cls.__module__}:{cls.__qualname__}",
                    "$fields": list(cls._fields)}
        if isinstance(o, (list, tuple)):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(o)]
            return {"$list": items} if isinstance(o, list) else {"$tuple": items}
        if isinstance(o, dict):
            items = []
            for k, v in o.items():
                jk = k if k is None or isinstance(k, (str, int, float, bool)) else {"$repr": repr(k)}
                key = json.dumps(k) if isinstance(k, str) else repr(k)  # no !r: it would apply to both
                items.append([jk, walk(v, f"{path}[{key}]")])
            return {"$dict": items}
        if objects.is_instance(o):  # a dataclass batch, by field, with its type to rebuild
            return {"$dataclass": objects.type_name(o),
                    "$fields": [[k, walk(v, f"{path}.{k}")] for k, v in objects.fields_of(o)]}
        if isinstance(o, torch.dtype):
            return {"$dtype": str(o).removeprefix("torch.")}
        if isinstance(o, torch.device):
            return {"$device": str(o)}
        return {"$repr": repr(o)[:200], "$type": type(o).__qualname__}

    return walk(obj, ""), tensors, paths


def batch_path(raw: str, n_args: int) -> str:
    """A readable name for a path into ``[list(args), kwargs]`` of a model call: the only
    positional argument is ``batch`` (``batch["image"]``), others ``args[1]``, keywords
    ``kwargs["mask"]``."""
    if raw.startswith("[0]["):
        i, _, rest = raw[4:].partition("]")
        return ("batch" if n_args == 1 and i == "0" else f"args[{i}]") + rest
    if raw.startswith("[1]"):
        return "kwargs" + raw[3:]
    return "batch" + raw


def loss_path(raw: str) -> str:
    """A readable name for a path into ``[list(args), kwargs]`` of a loss call."""
    if raw.startswith("[0]["):
        return "loss_args" + raw[3:]
    if raw.startswith("[1]"):
        return "loss_kwargs" + raw[3:]
    return "loss_args" + raw


class UnrebuildableLeaf(ValueError):
    """A batch leaf that was saved as its repr only (an arbitrary Python object)."""


def unflatten_tree(node: Any, tensors: dict[str, torch.Tensor], leaf=None) -> Any:
    """Inverse of :func:`flatten_tree`. Raises :class:`UnrebuildableLeaf` for repr-only leaves.
    ``leaf(node)``, when given, rebuilds the dict nodes it knows (it returns None for others)."""
    if isinstance(node, dict):
        if leaf is not None and (made := leaf(node)) is not None:
            return made
        if "$t" in node:
            return tensors[node["$t"]]
        if "$sparse" in node:
            return rebuild_sparse(node, tensors)
        if "$nested" in node:
            return rebuild_nested(node, tensors)
        if "$list" in node:
            return [unflatten_tree(v, tensors, leaf) for v in node["$list"]]
        if "$tuple" in node:
            items = [unflatten_tree(v, tensors, leaf) for v in node["$tuple"]]
            return _namedtuple(node, items) if "$namedtuple" in node else tuple(items)
        if "$dict" in node:
            return {(_key(k)): unflatten_tree(v, tensors, leaf) for k, v in node["$dict"]}
        if "$dataclass" in node:
            return _dataclass(node, tensors, leaf)
        if "$float" in node:
            return float(node["$float"])
        if "$dtype" in node:
            return getattr(torch, node["$dtype"])
        if "$device" in node:
            return torch.device(node["$device"])
        raise UnrebuildableLeaf(f"{node.get('$type', 'object')} {node.get('$repr', '')}")
    return node


def _dataclass(node: dict[str, Any], tensors: dict[str, torch.Tensor], leaf) -> Any:
    name, items = node["$dataclass"], node.get("$fields")
    if not (isinstance(name, str) and isinstance(items, list)
            and all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                    and i[0].isidentifier() for i in items)):
        raise UnrebuildableLeaf(f"dataclass {str(name)[:100]} with fields {str(items)[:100]}")
    return objects.rebuild(name, {k: unflatten_tree(v, tensors, leaf) for k, v in items})


def _key(k: Any) -> Any:
    if isinstance(k, dict):
        raise UnrebuildableLeaf(f"dict key {k.get('$repr')}")
    return k


def namedtuple_like(o: Any) -> bool:
    """``o`` is an instance of a namedtuple type (a tuple subclass naming each of its items in
    ``_fields``), as ``PackedSequence`` is."""
    fields = getattr(type(o), "_fields", None)
    return (isinstance(o, tuple) and isinstance(fields, tuple) and len(fields) == len(o)
            and all(isinstance(f, str) for f in fields))


def _namedtuple(node: dict[str, Any], items: list) -> tuple:
    """A recorded namedtuple's ``items`` as an instance of :func:`_tuple_type`."""
    name, fields = node["$namedtuple"], node.get("$fields")
    if not (isinstance(name, str) and isinstance(fields, list) and len(fields) == len(items)
            and all(isinstance(f, str) for f in fields)):
        raise UnrebuildableLeaf(f"namedtuple {str(name)[:100]} with fields {str(fields)[:100]}")
    cls = _tuple_type(name, tuple(fields))
    try:
        return cls(*items)
    except (TypeError, ValueError) as e:  # (its own __new__ may check more, as PackedSequence's)
        raise UnrebuildableLeaf(f"{name} ({type(e).__name__}: {e})") from None


def _tuple_type(name: str, fields: tuple[str, ...]) -> type:
    """The type to rebuild a namedtuple recorded as ``module:qualname`` with ``fields`` as: that
    type when its module is already imported (``torch.nn.utils.rnn``, whose ``PackedSequence``
    GRU and LSTM check for; the user's module the replay imported for the factory) and holds a
    tuple type of that name with the same fields; else a ``collections.namedtuple`` of that
    name and fields. Imports nothing and runs no module ``__getattr__``: a bundle's names are
    data, they choose no code to run."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, "__dict__", {}).get(part)
    if (isinstance(found, type) and issubclass(found, tuple)
            and getattr(found, "_fields", None) == fields):
        return found
    return _stand_in(qualname.rpartition(".")[2], fields)


@functools.lru_cache(maxsize=64)
def _stand_in(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple type for a recorded one whose own type is not at hand (one per name and
    fields, so equal records rebuild as equal types): its items keep their names."""
    if not name.isidentifier() or keyword.iskeyword(name):
        name = "RecordedTuple"
    return collections.namedtuple(name, fields, rename=True)


def tensor_leaves(obj: Any):
    """Yield every tensor in a nested structure of tuples, lists, dicts (Hugging Face's
    ``ModelOutput`` is one) and dataclass instances."""
    # (not torch.utils._pytree.tree_leaves: it keeps dict and list subclasses it does not
    # know, a user's ``class Batch(dict)``, as leaves, whose tensors would go unrecorded)
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensor_leaves(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensor_leaves(v)
    elif objects.is_instance(obj):  # (only leaves that are no tensor or container get here)
        for _, v in objects.fields_of(obj):
            yield from tensor_leaves(v)


def map_tensors(obj: Any, fn) -> Any:
    """``obj`` with every tensor in its tuples, lists, dicts and dataclass instances (a shallow
    copy) replaced by ``fn(tensor)``; other leaves kept as they are. A namedtuple keeps its type; a ``PackedSequence`` keeps its
    ``batch_sizes`` as they are, on the CPU, as its own ``.to()`` does (GRU and LSTM read them
    there, and its constructor refuses them elsewhere)."""
    # (not torch.utils._pytree.tree_map: it leaves unknown dict/list subclasses unmapped)
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, PackedSequence):
        return type(obj)(map_tensors(obj.data, fn), obj.batch_sizes,
                         map_tensors(obj.sorted_indices, fn), map_tensors(obj.unsorted_indices, fn))
    if namedtuple_like(obj):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if objects.is_instance(obj):
        return objects.replaced(obj, {k: map_tensors(v, fn) for k, v in objects.fields_of(obj)})
    return obj


# ---------------------------------------------------------------------------------------------
# Environment


def git_commit(cwd: str | None = None) -> str | None:
    """The commit checked out in ``cwd``, or None when it is not a git working tree."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def distributed_rank() -> tuple[int, int]:
    """(rank, world size): from torch.distributed when initialised, else torchrun's variables."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def environment(rank: int, world_size: int, commit: str | None) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda else [],
        "rank": rank,
        "world_size": world_size,
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "git_commit": commit,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
    }
