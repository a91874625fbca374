"""The replay package's structure limits (issue 13), read from its source with ``ast``: small
modules, classes and functions; private PyTorch APIs only in ``replay/compat.py``; no module
reading another object's private attributes; imports between its modules run one way.

A regression (a function grown past 60 lines, a ``t._version`` written in a new module) fails
here with the place named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPLAY = Path(__file__).resolve().parent.parent / "replay"
COMPAT = "compat.py"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 350, 60
# private attributes of torch objects (tensors, modules, ops, autograd nodes) and private torch
# modules; ``torch._x`` / ``nn._x`` are caught by their base name
TORCH_PRIVATE = re.compile(
    r"_version|_base|_schema|_parameters|_buffers|_modules|_non_persistent_buffers_set|"
    r"_python_dispatch|_pytree|_dynamo|_inductor|_C|_foreach_\w+|_NormBase|_scale|"
    r"_found_inf\w*|_per_optimizer_states|_orig_mod|_guards|_utils|_get_\w+|_local_scalar\w*")


def _modules() -> list[Path]:
    return sorted(REPLAY.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _private_attributes(tree: ast.Module):
    """``(line, text, base)`` of every ``x._name`` read where ``x`` is not self/cls."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            yield node.lineno, ast.unparse(node), base


def _private_torch_imports(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[0] == "torch"
                  and any(p.startswith("_") for p in n.split("."))]
    return found


def test_the_replay_package_has_its_modules():
    names = {p.name for p in _modules()}
    assert {COMPAT, "rerun.py", "analyze.py", "report.py", "html.py", "cli.py"} <= names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_module_class_and_function_sizes(path):
    src = path.read_text()
    assert len(src.splitlines()) <= MAX_MODULE, f"{path.name}: over {MAX_MODULE} lines"
    for node in ast.walk(_tree(path)):
        n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef):
            assert n <= MAX_CLASS, f"{path.name}:{node.lineno} class {node.name}: {n} lines"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert n <= MAX_FUNCTION, f"{path.name}:{node.lineno} {node.name}(): {n} lines"


@pytest.mark.parametrize("path", [p for p in _modules() if p.name != COMPAT],
                         ids=lambda p: p.name)
def test_private_torch_apis_and_private_reads_only_in_compat(path):
    tree = _tree(path)
    assert _private_torch_imports(tree) == [], f"{path.name} imports private torch modules"
    reads = [f"{path.name}:{line} {text}" for line, text, _ in _private_attributes(tree)]
    assert reads == [], "another object's private attribute read outside replay/compat.py"


def test_compat_is_where_the_private_torch_apis_are():
    tree = _tree(REPLAY / COMPAT)
    imports = _private_torch_imports(tree)
    assert "torch.utils._python_dispatch" in imports and "torch.utils._pytree" in imports
    attrs = {text.rpartition(".")[2] for _, text, _ in _private_attributes(tree)}
    assert attrs and all(TORCH_PRIVATE.fullmatch(a) for a in attrs), attrs


def test_the_checks_see_what_they_forbid():
    """The detectors flag the patterns the limits forbid (a check that sees nothing passes)."""
    tree = ast.parse("import torch.utils._pytree as p\nfrom torch._dynamo import x\n"
                     "def f(t, runner):\n    return t._version + runner._mb\n")
    assert _private_torch_imports(tree) == ["torch.utils._pytree", "torch._dynamo",
                                            "torch._dynamo.x"]
    assert [text for _, text, _ in _private_attributes(tree)] == ["t._version", "runner._mb"]


def _package_imports(tree: ast.Module) -> set[str]:
    """Modules of the package a module imports (``from . import x``, ``from .x import y``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_imports_between_replay_modules_have_no_cycle():
    graph = {p.stem: _package_imports(_tree(p)) for p in _modules() if p.stem != "__init__"}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, "import cycle: " + " -> ".join(path + (name,))
        if name in done or name not in graph:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + (name,))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
