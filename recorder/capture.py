"""What a step needs to be re-run: nested batches as (JSON tree, tensors), the environment (the
RNG states are :mod:`recorder.rng`'s).

Everything here is plain data: trees become JSON with tensor leaves named by key, so a bundle
never needs pickle to say what the batch looked like.
"""

from __future__ import annotations

import collections
import functools
import json
import keyword
import math
import os
import platform
import subprocess
import sys
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

from . import objects, tensor_collections
from .compat import distributions_validate_default
from .numeric_switches import numeric_switches
from .numpy_values import numpy_node, numpy_rebuilt
from .objects import UnrebuildableLeaf, member
from .sparse import SPARSE, nested_node, rebuild_nested, rebuild_sparse, sparse_node

# ---------------------------------------------------------------------------------------------
# Nested batches <-> JSON tree + named tensors


def _json_float(x: float) -> Any:
    # repr of the float itself: a subclass's (NumPy's float64 from a schedule's np.exp, a
    # float before the NumPy scalars are seen) reads 'np.float64(nan)', which float() refuses
    return x if math.isfinite(x) else {"$float": repr(float(x))}


def flatten_tree(obj: Any, prefix: str, leaf=None, whole=None
                 ) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """Encode ``obj`` as JSON; tensor leaves are returned under keys ``prefix/<n>``, with a
    readable path for each key, such as ``[0]["image"]``. Leaves that are neither tensors nor
    JSON scalars are kept as their ``repr`` and marked, so the replay can say it cannot rebuild
    them instead of guessing, unless ``whole(o)`` stands in for them (a model output that is a
    ``torch.distributions.Normal``)."""
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
                jk = _json_key(k)
                key = json.dumps(k) if isinstance(k, str) else repr(k)  # no !r: it would apply to both
                items.append([jk, walk(v, f"{path}[{key}]")])
            return {"$dict": items}
        if (made := tensor_collections.described(o) or objects.described(o)) is not None:
            tag, name, items, *size = made  # (a dataclass, PyG's Batch, a TensorDict and its
            return {tag: name, **dict(size),  # batch size: by field or key, with its type)
                    "$fields": [[k, walk(v, path + member(tag, k))] for k, v in items]}
        if isinstance(o, torch.dtype):
            return {"$dtype": str(o).removeprefix("torch.")}
        if isinstance(o, torch.device):
            return {"$device": str(o)}
        if whole is not None and (node := whole(o)) is not None:
            return node
        return numpy_node(o, path, put) or {"$repr": repr(o)[:200], "$type": type(o).__qualname__}

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


def tree_refs(node: Any, key: str):
    """Every value a flattened tree (:func:`flatten_tree`, a bundle's JSON) holds under
    ``key`` in its nodes, in order: ``"$t"`` the tensors' keys, ``"$in"`` the references to
    a micro-batch's inputs."""
    if isinstance(node, dict):
        if key in node:
            yield node[key]
        for v in node.values():
            yield from tree_refs(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from tree_refs(v, key)


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
        if "$keyed" in node:
            return _keyed(node, tensors, leaf)
        if "$mapping" in node:
            return _mapping(node, tensors, leaf)
        if (tag := tensor_collections.tag_of(node)) is not None:  # (TensorDict, tensorclass)
            return tensor_collections.rebuilt(node, *_fields(node, tag, "collection", tensors,
                                                             leaf, names=False))
        if "$float" in node:
            return float(node["$float"])
        if "$numpy" in node or "$ndarray" in node:
            return numpy_rebuilt(node, lambda inner: unflatten_tree(inner, tensors, leaf))
        if "$dtype" in node:
            return getattr(torch, node["$dtype"])
        if "$device" in node:
            return torch.device(node["$device"])
        raise UnrebuildableLeaf(f"{node.get('$type', 'object')} {node.get('$repr', '')}")
    return node


def _fields(node: dict[str, Any], tag: str, what: str, tensors: dict[str, torch.Tensor], leaf,
            names: bool = True) -> tuple[Any, dict[str, Any]]:
    """(the recorded type, its fields or keys rebuilt) of an object node ``tag`` (a type's name,
    ``$keyed``: its names), ``names``: the keys must be identifiers; a malformed node raises."""
    kind, items = node[tag], node.get("$fields")
    kinds = kind if tag == "$keyed" else [kind]
    if not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)
            and isinstance(items, list)
            and all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                    and (not names or i[0].isidentifier()) for i in items)):
        raise UnrebuildableLeaf(f"{what} {str(kind)[:100]} with "
                                f"{'fields' if tag == '$dataclass' else 'keys'} {str(items)[:100]}")
    return kind, {k: unflatten_tree(v, tensors, leaf) for k, v in items}


def _dataclass(node: dict[str, Any], tensors: dict[str, torch.Tensor], leaf) -> Any:
    return objects.rebuild(*_fields(node, "$dataclass", "dataclass", tensors, leaf))


def _keyed(node: dict[str, Any], tensors: dict[str, torch.Tensor], leaf) -> Any:
    """A keyed batch object (:func:`recorder.objects.is_keyed`) rebuilt by its type's
    ``from_dict``; a stand-in holding its keys as attributes when that type is not at hand."""
    names, values = _fields(node, "$keyed", "object", tensors, leaf)
    made = objects.rebuild_keyed(names, values)
    return made if made is not None else objects.rebuild(names[0] if names else "", values)


def _json_key(k: Any) -> Any:
    """A dict key as JSON: a scalar as itself; a tuple of such (monodepth2's
    ``outputs[("disp", 0)]``, ``inputs[("color", 0, -1)]``) marked as one, to be rebuilt
    hashable; anything else as its repr, which the replay refuses."""
    if k is None or isinstance(k, (str, int, float, bool)):
        return k
    if type(k) is tuple:
        items = [_json_key(i) for i in k]
        if not any(isinstance(i, dict) and "$repr" in i for i in items):
            return {"$tuple": items}
    return {"$repr": repr(k)}


def _key(k: Any) -> Any:
    if isinstance(k, dict):
        if isinstance(items := k.get("$tuple"), list):
            return tuple(_key(i) for i in items)
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


def _mapping(node: dict[str, Any], tensors: dict[str, torch.Tensor], leaf) -> Any:
    """A mapping that is no dict (a ``BatchEncoding``), rebuilt as its type when at hand."""
    return objects.rebuild_mapping(*_fields(node, "$mapping", "mapping", tensors, leaf,
                                            names=False))


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
    elif objects.is_keyed(obj):  # (PyG's Data and Batch)
        for _, v in objects.keyed_items(obj):
            yield from tensor_leaves(v)
    elif objects.is_mapping(obj):  # (a tokenizer's BatchEncoding)
        for v in obj.values():
            yield from tensor_leaves(v)


# a distribution's log-probabilities: -inf is a probability of 0 (a masked action's logit)
_LOG_PROBABILITIES = {"logits"}


def output_leaves(obj: Any, inf_ok: set[int] | None = None):
    """:func:`tensor_leaves`, then the tensors held by the ``torch.distributions`` objects in
    ``obj`` (a forecaster's ``Normal(loc, scale)``, a ``TransformedDistribution``'s base and
    affine transforms), each tensor once: a model's output is checked through them, and the
    gradient entering them is kept as a tensor output's is. ``inf_ok`` is given the ids of
    their logits, whose +-inf is a probability of 0 or 1, not an overflow."""
    seen = set()
    for t in (*tensor_leaves(obj), *object_tensors(obj, inf_ok=inf_ok)):
        if id(t) not in seen:  # (NegativeBinomial's _param is its logits)
            seen.add(id(t))
            yield t


def object_tensors(obj: Any, depth: int = 0, inf_ok: set[int] | None = None):
    """The tensors of the ``torch.distributions`` objects in the containers of ``obj``, and
    the tensor attributes of the plain objects there (a model returning its own ``class
    Prediction`` with ``self.mean``, ``self.scale``; dataclasses are :func:`tensor_leaves`')."""
    dist = torch.distributions
    if depth > 4:  # (a base distribution's transforms: a few levels at most)
        return
    if isinstance(obj, (list, tuple)):
        for v in obj:
            yield from object_tensors(v, depth, inf_ok)
    elif isinstance(obj, dict) or objects.is_mapping(obj):
        for v in obj.values():
            yield from object_tensors(v, depth, inf_ok)
    elif _plain_object(obj):
        for v in vars(obj).values():
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, (list, tuple, dict)) or _plain_object(v):
                yield from object_tensors(v, depth + 1, inf_ok)
    elif isinstance(obj, (dist.Distribution, dist.transforms.Transform)):
        for k, v in getattr(obj, "__dict__", {}).items():  # (a subclass may use __slots__)
            if isinstance(v, torch.Tensor):
                if inf_ok is not None and k in _LOG_PROBABILITIES:
                    inf_ok.add(id(v))
                yield v
            elif isinstance(v, (list, tuple, dist.Distribution, dist.transforms.Transform)):
                yield from object_tensors(v, depth + 1, inf_ok)


def _plain_object(o: Any) -> bool:
    """An instance of a user's class holding its values as attributes: no tensor, module,
    container, class, function or distribution, and no dataclass (walked by its fields)."""
    return hasattr(o, "__dict__") and not isinstance(
        o, (torch.Tensor, torch.nn.Module, type, torch.distributions.Distribution,
            torch.distributions.transforms.Transform, PackedSequence)) \
        and not callable(o) and not objects.is_instance(o) \
        and type(o).__module__ not in ("builtins", "types")


def data_arguments(call: Any, outputs: Any) -> list[torch.Tensor]:
    """The floating tensors of a loss call's arguments ``call`` that are neither the model's
    ``outputs`` nor made with a gradient: its targets."""
    outs = {id(t) for t in output_leaves(outputs)}
    return [t for t in tensor_leaves(call) if t.is_floating_point() and id(t) not in outs
            and not t.requires_grad]


def distribution_labels(obj: Any, depth: int = 0) -> dict[int, str]:
    """``id(tensor)`` -> ``"StudentT.scale"`` for the tensors of the distributions in ``obj``
    (a report names the one whose gradient went bad)."""
    dist, labels = torch.distributions, {}
    items = obj if isinstance(obj, (list, tuple)) else obj.values() if isinstance(obj, dict) \
        else [obj]
    for o in items if depth <= 4 else ():
        if isinstance(o, (list, tuple, dict)):
            labels.update(distribution_labels(o, depth + 1))
        elif isinstance(o, (dist.Distribution, dist.transforms.Transform)):
            for k, v in getattr(o, "__dict__", {}).items():
                if isinstance(v, torch.Tensor):
                    labels.setdefault(id(v), f"{type(o).__name__}.{k}")
                elif isinstance(v, (list, tuple, dist.Distribution, dist.transforms.Transform)):
                    labels.update({i: n for i, n in distribution_labels(v, depth + 1).items()
                                   if i not in labels})
    return labels


def as_called(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A root call's ``args`` and ``kwargs`` with their dicts and lists copied (the tensors
    kept): a forward that writes its predictions into its input dict (SchNetPack's, which
    returns it, the targets' keys overwritten) must not change the batch the bundle holds.
    Arguments with neither are kept as they are."""
    for v in (*args, *kwargs.values()) if kwargs else args:  # (a loop: it runs every step)
        if isinstance(v, (dict, list)) or type(v) is not torch.Tensor and (
                objects.is_mapping(v) or tensor_collections.is_collection(v)):
            # (a BatchEncoding, a TensorDict, which TensorDictModule writes into; a tensorclass)
            return map_tensors(args, _kept), map_tensors(kwargs, _kept)
    return args, kwargs


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


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
    if tensor_collections.is_collection(obj):  # (before the dataclasses: a tensorclass is one)
        return tensor_collections.mapped(obj, fn)
    if objects.is_instance(obj):
        return objects.replaced(obj, {k: map_tensors(v, fn) for k, v in objects.fields_of(obj)})
    if objects.is_keyed(obj):  # (a copy made by its own type, as the replay rebuilds it)
        made = objects.rebuild_keyed(objects.keyed_type(obj),
                                     {k: map_tensors(v, fn) for k, v in objects.keyed_items(obj)})
        return obj if made is None else made
    if objects.is_mapping(obj):
        return objects.mapped(obj, {k: map_tensors(v, fn) for k, v in obj.items()})
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
        # (a run that turned it off re-runs with it off: else the replay's Distribution
        # raises on the values whose NaN the training went on to make)
        "distributions_validate_args": distributions_validate_default(),
        **numeric_switches(),  # (default dtype, flush-denormal, matmul precision: re-set too)
    }
