"""What rebuilds the loss at replay, written into the bundle without the user's help.

A loss module is described by its class's import path (``"pkg.losses:FocalLoss"``), its plain
JSON-valued attributes (``reduction``, ``ignore_index``, ``blank``, ``gamma``, ...), its tensors
(buffers, parameters, plain tensor attributes such as class weights: stored as ``loss/<name>``)
and its submodules, described the same way. A loss function is described by its
``module:qualname`` when that path imports it back. Nothing is pickled: the replay imports the
class or function under its trust rule and sets the recorded attributes
(``replay.losses``). One defined in the training script itself (``python train.py``) is
described by the script's module name (``train:my_loss``) when the script's training is under
the ``__main__`` guard, so importing it runs none. What cannot be imported (a lambda, a
closure, a script without that guard) is described with the reason, so the replay can say so.

>>> import torch.nn as nn                                            # doctest: +SKIP
>>> describe_loss(nn.CrossEntropyLoss(ignore_index=0), {})["tree"]["config"]
{'reduction': 'mean', 'ignore_index': 0, 'label_smoothing': 0.0}
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .compat import compiled_original, own_slots, uncompiled
from .compiled import compiled_loss
from .scripted import is_scripted, script_function_home
from .validate import SCRIPT_MODULES, import_object, script_module


def describe_loss(loss_fn: nn.Module, tensors: dict[str, torch.Tensor],
                  modules: dict[int, str] | None = None) -> dict[str, Any]:
    """The bundle's ``loss`` entry for the recorder's ``loss_fn`` (a module, or the module the
    recorder wraps a plain function in); tensors go into ``tensors`` under ``loss/``. A
    submodule the loss shares with the model (``modules``: its modules by id, named, as
    ``Target.module_ids`` gives them; a perceptual loss given the model's own ``self.vgg``;
    the model itself, ``Loss(model)``, as ``""``) is named by its name in the model too
    (``"model": "vgg"``), for the replay to give the rebuilt loss the rebuilt model's. A
    ``torch.compile``'d loss module is described as the module it wraps (the replay runs the
    loss eagerly, as it runs the model), a compiled function as the function it compiled;
    either is marked ``"compiled": true``."""
    compiled = {"compiled": True} if compiled_loss(loss_fn) else {}
    loss_fn = uncompiled(loss_fn)  # (an OptimizedModule's class cannot be rebuilt)
    fn = getattr(loss_fn, "fn", None)
    if fn is not None and type(loss_fn).__name__ == "_CallableLoss":
        fn = compiled_original(fn)
        held = _model_globals(fn, modules or {})
        return {"kind": "function", **(_describe_method(fn) or describe_callable(fn)),
                **compiled, **({"model_globals": held} if held else {})}
    shared = dict(modules or {})  # (the root too, as "": a loss given the model itself)
    tree = _describe_module(loss_fn, "", tensors, shared)
    if shared.get(id(loss_fn)):  # the model's own submodule (a LightningModule's self.loss)
        tree["model"] = shared[id(loss_fn)]
    # the flat fields older replays read (a torch.nn built-in rebuilt from its arguments)
    try:
        accepted = set(inspect.signature(type(loss_fn).__init__).parameters)
    except (TypeError, ValueError):
        accepted = set()
    return {"kind": "module", "class": tree["class"], "config": tree["config"],
            "init_args": sorted(accepted - {"self", "args", "kwargs"}),
            "buffers": [n for n, _ in loss_fn.named_buffers()], "tree": tree, **compiled}


def _model_globals(fn, modules: dict[int, str]) -> list[str]:
    """The global names a loss function reads that hold the recorded model itself (a script's
    ``critic``, which its gradient penalty calls): the replay binds them to the rebuilt model
    while it re-runs the function, which else would call the module's own, other instance."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or not isinstance(scope, dict):
        return []
    return [n for n in code.co_names if modules.get(id(scope.get(n))) == ""]


def describe_callable(fn) -> dict[str, Any]:
    """``{"name", "import"}`` of a function or class importable by ``module:qualname``, else
    ``{"name", "why", "defined"}`` saying why not (``defined``: its ``file:line``). A
    ``functools.partial`` of an importable function with JSON arguments adds ``"partial":
    {"args", "keywords"}``."""
    if isinstance(fn, functools.partial):
        inner = describe_callable(fn.func)
        if "import" in inner and json_plain(list(fn.args)) and json_plain(dict(fn.keywords)):
            inner["partial"] = {"args": to_json(list(fn.args)),
                                "keywords": to_json(dict(fn.keywords))}
            inner["name"] = f"functools.partial({inner['name']})"
            return inner
        return {"name": f"functools.partial({inner['name']})", "why": "partial",
                **{k: v for k, v in inner.items() if k == "defined"}}
    if is_scripted(fn):  # (its class is RecursiveScriptModule's; its eager one is lost)
        return {"name": f"torch.jit.script({getattr(fn, 'original_name', '?')}())",
                "why": "scripted"}
    module = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if (home := script_function_home(fn)) is not None:  # (its class's names, not its own)
        module, qual = home
    why = _not_importable(fn, module, qual)
    name = getattr(fn, "__name__", None)
    if why == "not importable" and isinstance(name, str) and name != qual \
            and _not_importable(fn, module, name) is None:
        qual = name  # (torch.mean: a builtin whose qualname, _VariableFunctionsClass.mean, is
        why = None  # its class's, exported by its module under its own name)
    out: dict[str, Any] = {"name": f"{module or '?'}.{qual}"}
    if why == "script" and (name := script_module()) is not None and _in_main(fn, qual):
        # the training script, whose training is under the __main__ guard: the replay imports
        # it under its own name, as it does the factory it defines (``train:make_model``)
        out["import"] = f"{name}:{qual}"
        return out
    if why is None:
        out["import"] = f"{module}:{qual}"
        return out
    out["why"] = why
    if (where := defined_at(fn)) is not None:
        out["defined"] = where
    return out


def _describe_method(fn) -> dict[str, Any] | None:
    """A method bound to an instance of a plain class (VoxelMorph's ``losses.NCC().loss``), or
    an instance of a plain class called as the loss (neuraloperator's ``LpLoss()``: its
    ``__call__``), as its class's import path, the method's name and the instance's
    attributes, when the class imports back and every attribute is a JSON value (``win``,
    ``p``) or a plain object of JSON values (``self.stats = RunningMean()``: ``objects``);
    None otherwise."""
    obj, method = getattr(fn, "__self__", None), getattr(fn, "__name__", None)
    if _callable_instance(fn):
        obj, method = fn, "__call__"
    elif not inspect.ismethod(fn):
        return None
    if obj is None or isinstance(obj, (type, nn.Module)) or not hasattr(obj, "__dict__"):
        return None
    state = {k: v for k, v in vars(obj).items() if json_plain(v)}
    objects = {k: _plain_object(v) for k, v in vars(obj).items() if k not in state}
    if any(held is None for held in objects.values()):
        return None
    cls = describe_callable(type(obj))
    if "import" not in cls:
        return None
    name = cls["name"] if obj is fn else f"{cls['name']}.{method}"
    return {"name": name, "import": cls["import"],
            "method": method, "state": to_json(state),
            "tuples": sorted(k for k, v in state.items() if isinstance(v, tuple)),
            **({"objects": objects} if objects else {})}


def _plain_object(v: Any) -> dict[str, Any] | None:
    """An instance of an importable plain class (no module, tensor or container) whose
    attributes are all JSON values or importable functions (pytorch-metric-learning's
    ``TorchInitWrapper(torch.nn.init.normal_)``, the ``weight_init_func`` of every loss with
    proxies or class weights): ``{"import", "state", "tuples", "functions"}`` to make it again
    without its constructor, else None."""
    if isinstance(v, (type, nn.Module, torch.Tensor, functools.partial, types.ModuleType)) \
            or callable(v) and not _callable_instance(v) \
            or type(v).__module__ == "builtins" or not isinstance(getattr(v, "__dict__", None), dict):
        return None
    cls = describe_callable(type(v))
    if "import" not in cls:
        return None
    state, functions = {}, {}
    for k, x in vars(v).items():
        if json_plain(x):
            state[k] = to_json(x)
        elif isinstance(x, (types.FunctionType, types.BuiltinFunctionType, type)) and \
                "import" in (d := describe_callable(x)):
            functions[k] = d["import"]
        else:
            return None
    return {"import": cls["import"], "state": state, "functions": functions,
            "tuples": sorted(k for k, x in vars(v).items() if isinstance(x, tuple))}


def _callable_instance(fn) -> bool:
    """``fn`` is an instance of a class of the user's that defines ``__call__``, not a
    function, method, class, partial or module."""
    return callable(fn) and not isinstance(fn, (
        types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
        functools.partial, nn.Module)) and "__call__" in vars(type(fn)) \
        and type(fn).__module__ not in ("builtins", "functools")


def defined_at(fn) -> str | None:
    """``file:line`` where function ``fn`` is defined (its file relative to the current
    directory when below it), None for what has no code (a builtin, a class)."""
    code = getattr(fn, "__code__", None)
    return f"{_short(code.co_filename)}:{code.co_firstlineno}" if code is not None else None


def factory_path(factory, kwargs: dict | None) -> tuple[str, dict | None]:
    """A factory given as the function itself (``factory=make_model``) as the bundle stores
    it: ``"module:function"``, with a ``functools.partial``'s keywords joined to ``kwargs``
    (``kwargs`` wins). A function no import path leads to is refused in one line."""
    if not callable(factory):
        raise TypeError(f"FlightRecorder: factory must be 'module:function' or a module-level "
                        f"function that builds the model, got {type(factory).__name__}")
    d = describe_callable(factory)
    partial = d.get("partial")
    if "import" not in d or (partial and partial["args"]):
        if partial and partial["args"]:
            why = "a partial with positional arguments"
        else:
            why = {"lambda": "a lambda", "closure": "defined inside a function",
                   "script": "defined in a script nanreplay cannot import",
                   "partial": "a partial with arguments that are not JSON values"}.get(
                       d.get("why"), "not importable by its name")
        where = f", at {d['defined']}" if "defined" in d else ""
        raise ValueError(f"FlightRecorder: factory {d['name']} cannot be rebuilt by nanreplay "
                         f"({why}{where}); pass a module-level function that builds the "
                         "model, or 'module:function', and its settings as factory_kwargs")
    if partial and partial["keywords"]:
        kwargs = {**partial["keywords"], **(kwargs or {})}
    return d["import"], kwargs


def _not_importable(fn, module: str | None, qual: str) -> str | None:
    if "<lambda>" in qual:
        return "lambda"
    if "<locals>" in qual:
        return "closure"  # defined inside a function: no import path leads to it
    if not isinstance(module, str):
        return "no module"
    if module in SCRIPT_MODULES:
        return "script"  # the training script itself: importing it would run the training
    try:
        found = import_object(module, qual)
    except Exception:
        return "not importable"
    # (a function compiled where it is defined, @torch.compile: the name holds the compiled one)
    return None if found is fn or compiled_original(found) is fn else "not importable"


def _in_main(fn, qual: str) -> bool:
    """``__main__.<qual>`` is ``fn`` (looked up, never imported)."""
    obj = sys.modules.get("__main__")
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _numeric_array(v) -> torch.Tensor | None:
    """A NumPy array of numbers as a tensor (a copy), else None. NumPy is not imported here:
    only a program that has imported it can hold one."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
        return None
    try:
        return torch.from_numpy(np.ascontiguousarray(v).copy())
    except (TypeError, ValueError):  # (a byte order or dtype torch does not take)
        return None


def _describe_module(m: nn.Module, prefix: str, tensors: dict[str, torch.Tensor],
                     shared: dict[int, str]) -> dict[str, Any]:
    cls = type(m)
    non_persistent, buffers, params, children = own_slots(m)
    node: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                            "training": m.training, "config": {}, "tuples": [], "tensors": {},
                            "functions": {}, "buffers": {}, "params": {}, "frozen": [],
                            "non_persistent": sorted(non_persistent),
                            "children": {}, "unrecorded": []}
    where = describe_callable(cls)
    node.update({k: v for k, v in where.items() if k in ("import", "why")})
    for k, v in vars(m).items():
        if k.startswith("_") or k == "training":
            continue
        if json_plain(v):
            node["config"][k] = to_json(v)
            if isinstance(v, tuple):
                node["tuples"].append(k)
        elif _number_keyed(v):  # (scale weights keyed by stride, {2: 0.32, 4: 0.08})
            node["config"][k] = {"$dict": [[key, to_json(x)] for key, x in v.items()]}
        elif isinstance(v, torch.Tensor):
            key = f"loss/{prefix}{k}"
            tensors[key] = v.detach()
            node["tensors"][k] = key
        elif (t := _numeric_array(v)) is not None:  # (DINO's teacher temperature schedule)
            key = f"loss/{prefix}{k}"
            tensors[key] = t
            node.setdefault("arrays", {})[k] = key
        elif isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)) and \
                "import" in describe_callable(v):
            node["functions"][k] = describe_callable(v)["import"]
        elif (held := _plain_object(v)) is not None:
            node.setdefault("objects", {})[k] = held
        elif getattr(getattr(v, "__wrapped__", None), "__self__", None) is m:
            continue  # its own method, wrapped by its construction (torchmetrics' update)
        else:
            node["unrecorded"].append(f"{k} ({_unstored(v)})")
    for k, b in buffers.items():
        key = None if b is None else f"loss/{prefix}{k}"
        if b is not None:
            tensors[key] = b.detach()
        node["buffers"][k] = key
    for k, p in params.items():
        key = None if p is None else f"loss/{prefix}{k}"
        if p is not None:
            tensors[key] = p.detach()
            if not p.requires_grad:
                node["frozen"].append(k)
        node["params"][k] = key
    for k, c in children.items():
        c = None if c is None else uncompiled(c)
        node["children"][k] = None if c is None else _describe_module(c, f"{prefix}{k}.",
                                                                      tensors, shared)
        if c is not None and id(c) in shared:  # (described too: a replay that predates it)
            node["children"][k]["model"] = shared[id(c)]
    return node


def _unstored(v: Any) -> str:
    """What an attribute the bundle cannot store is: its type's name, or for a function no
    import path leads to, why and where (``a lambda at train.py:12``: a triplet loss's
    ``distance_function``)."""
    if isinstance(v, types.FunctionType):
        why = {"lambda": "a lambda", "closure": "a function defined inside a function",
               "script": "a function of the script run as __main__"}.get(
                   describe_callable(v).get("why"))
        if why:
            return why + (f" at {at}" if (at := defined_at(v)) else "")
    return type(v).__name__


def json_plain(v: Any) -> bool:
    """A value JSON holds as it is: scalars, and lists, tuples and string-keyed dicts of them."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(json_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and json_plain(x) for k, x in v.items())
    return False


def _number_keyed(v: Any) -> bool:
    """A dict of plain values whose keys are JSON scalars, not all strings (JSON would make
    its keys strings: kept as its pairs)."""
    return isinstance(v, dict) and bool(v) and all(
        isinstance(k, (bool, int, float, str)) and json_plain(x) for k, x in v.items())


def to_json(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    return v
