"""The code the recorded step ran, by fingerprint: at an event only (never per step), a hash
of each class of the model's modules and of the loss, and of the functions of their own files
their methods call by name (a ``safe_div`` helper). The hash is of the source's syntax tree
without docstrings, so a comment, a blank line or a reformatting is no edit; torch's own
classes are left out (the bundle names the torch version). The replay compares it with the
code it imports (``replay.edited_code``): an eps added since the run is told from a
nondeterministic step, and a renamed module from a factory built with other arguments. A class
of the training script run as ``python train.py`` (module ``__main__``) is keyed by the name
the replay imports that script as (``train.Net``, ``validate.script_module``); one of a
notebook (a ``__main__`` without a file) has no such name, and no key."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import os
import sys
import types
from typing import Any

from torch import nn

from .validate import SCRIPT_MODULES, script_module

_MAX = 64  # classes and functions fingerprinted at most (a large library model: its first)


def fingerprint(obj: Any) -> str | None:
    """The hash of a class's or function's source, docstrings and comments left out; None
    when it has no source to read (a builtin, a class made at run time, one defined inside a
    function). Read from its file's syntax tree, parsed once per file version: torch's
    ``inspect.getsource`` of a class parses the whole file again at every call (24 ms a class
    in a 1,000-line module), at every bundle and every replay."""
    try:
        path = inspect.getsourcefile(obj)
        qual = obj.__qualname__
        stat = os.stat(path) if path else None
    except (OSError, TypeError, AttributeError):
        return None
    if stat is None or not isinstance(qual, str):
        return None
    return _digests(path, stat.st_mtime_ns, stat.st_size).get(qual)


@functools.lru_cache(maxsize=256)
def _digests(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    """{qualname: hash} of every class and function defined in the file (nested ones by their
    dotted names; a later definition of a name replaces an earlier one, as it does when the
    module runs). The hash is of the definition's syntax tree with its docstrings left out
    (positions are not dumped: a line added above it is no edit). Only the hashes are kept:
    cached trees (a few hundred thousand objects for 32 files) slowed every garbage collection
    and ``gc.get_referrers`` of the process, the training's too."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            n.body = body[1:] or [ast.Pass()]
    out: dict[str, str] = {}
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, defs):
                qual = prefix + child.name
                out[qual] = hashlib.sha256(ast.dump(child).encode()).hexdigest()[:16]
                visit(child, qual + ("." if isinstance(child, ast.ClassDef) else ".<locals>."))
            elif not isinstance(child, ast.expr):  # (the if/try blocks of a module)
                visit(child, prefix)

    visit(tree, "")
    return out


def key_of(obj: Any, script: str | None = None) -> str | None:
    """``module.Qualname``; for the training script's code, ``script`` (the name the replay
    imports it as) for its module, None without one (a notebook, a script without the guard)."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    if mod in SCRIPT_MODULES:
        if script is None or not _in_script(obj):
            return None
        mod = script
    return f"{mod}.{qual}"


def _in_script(obj: Any) -> bool:
    """``obj``'s source is the file run as ``__main__`` (not a class given that module name
    by hand, which another file or an exec'd string defines)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    try:
        return isinstance(main, str) and os.path.samefile(inspect.getsourcefile(obj) or "", main)
    except (OSError, TypeError, ValueError):
        return False


def is_own(obj: Any) -> bool:
    """Code the bundle's torch version does not already name: not torch's, not the recorder's."""
    mod = getattr(obj, "__module__", None) or ""
    top = mod.partition(".")[0]
    return top not in ("torch", "builtins", "recorder", "functools")


def _called_functions(cls_or_fn: Any) -> list[Any]:
    """The plain functions of the same file that the code calls by a global name."""
    mod = sys.modules.get(getattr(cls_or_fn, "__module__", None) or "")
    if mod is None:
        return []
    fns = list(vars(cls_or_fn).values()) if isinstance(cls_or_fn, type) else [cls_or_fn]
    codes = [f.__code__ for f in (getattr(f, "__func__", f) for f in fns)
             if isinstance(f, types.FunctionType)]
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    found = (getattr(mod, n, None) for n in sorted(names))
    return [f for f in found if isinstance(f, types.FunctionType)
            and f.__module__ == mod.__name__]


def _objects(model: nn.Module | None, loss_fn: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    if isinstance(loss_fn, nn.Module) and not is_own(type(loss_fn)) \
            and callable(getattr(loss_fn, "fn", None)):  # (the recorder's wrapper of a function)
        loss_fn = loss_fn.fn
    loss_fn = getattr(loss_fn, "_orig_mod", loss_fn)  # (a compiled loss module: its own)
    roots = [type(m) for m in model.modules()] if model is not None else []
    if isinstance(loss_fn, nn.Module):
        roots += [type(m) for m in loss_fn.modules()]
    elif loss_fn is not None:
        fn = getattr(loss_fn, "func", loss_fn)  # (a functools.partial's function)
        roots.append(getattr(fn, "__func__", fn))  # (a bound method's)
    for obj in roots:
        if len(seen) < _MAX and id(obj) not in seen and is_own(obj):
            seen[id(obj)] = obj
            for f in _called_functions(obj):
                seen.setdefault(id(f), f)
    return list(seen.values())[:_MAX]


def code_identity(model: nn.Module | None, loss_fn: Any) -> dict[str, dict[str, str]]:
    """{"mod.Qualname": {"hash", "file"}} of the model's and the loss's own code."""
    out: dict[str, dict[str, str]] = {}
    try:
        script = script_module()  # (read once: it parses the script for its guard)
        for obj in _objects(model, loss_fn):
            key = key_of(obj, script)
            digest = fingerprint(obj) if key is not None else None
            if key is not None and digest is not None:
                file = inspect.getsourcefile(obj) or "?"
                out[key] = {"hash": digest, "file": file}
    except Exception:  # noqa: BLE001 - a fingerprint must never stop the bundle's writing
        return out
    return out
