"""The layout limits of issue 13, read from the source (an AST walk), so a regression fails here:
no module over 500 lines, no class over 350, no function over 60; private PyTorch APIs only in
the package's ``compat`` module; no reading of another object's private attributes outside it;
no import cycle between the package's modules. One package per parameter."""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["recorder", "replay"]

MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 350, 60
# private names of torch's own (attributes and modules) that only the compat module may use
TORCH_PRIVATE = re.compile(
    r"_foreach_\w+|_version|_base|_dynamo|_NormBase|_pytree|_python_dispatch|_scale|"
    r"_found_inf\w*|_per_optimizer_states|_C|_guards|_local_scalar\w*|_get_\w+|_orig_mod|"
    r"_FSDP\w*|_utils|_compiled_call_impl|_torchdynamo_\w+|_parameters|_buffers|_modules|"
    r"_non_persistent_buffers_set")


def _modules(package: str) -> dict[str, ast.Module]:
    return _parsed(ROOT / package)


@functools.cache
def _parsed(folder: Path) -> dict[str, ast.Module]:
    """Each module's tree, parsed once for all the checks (which only read them)."""
    return {p.name: ast.parse(p.read_text(), str(p)) for p in sorted(folder.glob("*.py"))}


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


@pytest.mark.parametrize("package", PACKAGES)
def test_sizes(package):
    too_big = []
    for name, tree in _modules(package).items():
        lines = len((ROOT / package / name).read_text().splitlines())
        if lines > MAX_MODULE:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(tree):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and n > MAX_CLASS:
                too_big.append(f"class {name}:{node.name}: {n} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION:
                too_big.append(f"function {name}:{node.name}: {n} lines")
    assert not too_big, too_big


@pytest.mark.parametrize("package", PACKAGES)
def test_private_torch_only_in_compat(package):
    found = []
    for name, tree in _modules(package).items():
        if name == "compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and (
                    TORCH_PRIVATE.fullmatch(node.attr)
                    or isinstance(node.value, ast.Name) and node.value.id in ("torch", "nn")):
                found.append(f"{name}:{node.lineno} .{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                found += [f"{name}:{node.lineno} import {m}" for m in mods
                          if "torch" in m and any(_private(p) for p in m.split("."))]
    assert not found, found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_foreign_private_reads(package):
    """``x._name`` where ``x`` is not ``self``/``cls``: another object's private state (a part
    that needs it gets a public attribute instead; torch's private state lives in compat)."""
    found = []
    for name, tree in _modules(package).items():
        if name == "compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    """Dependencies between the package's modules run one way (imports inside functions too)."""
    graph: dict[str, set[str]] = {}
    for name, tree in _modules(package).items():
        deps = graph.setdefault(name.removesuffix(".py"), set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                deps.add(node.module.split(".")[1])
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(mod):] + [mod])}")
        if mod in done or mod not in graph:
            return
        for dep in sorted(graph[mod]):
            visit(dep, path + [mod])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])


def _layout_table() -> str:
    """The README's layout table (the rows from its header to the next heading)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout")
    end = text.find("\n## ", start + 1)
    return text[start: end if end != -1 else len(text)]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_has_a_layout_row(package):
    """A newcomer finds each concept from the README's layout table: every module of the
    package is named there (as `package/module.py`), so a module added without its row fails."""
    table = _layout_table()
    missing = [f"{package}/{p.name}" for p in sorted((ROOT / package).glob("*.py"))
               if not p.name.startswith("__") and f"`{package}/{p.name}`" not in table]
    assert not missing, f"modules with no row in README.md's layout table: {missing}"
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = [m for cell in rows for m in re.findall(rf"`({package}/\w+\.py)`", cell)]
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"modules with more than one row in README.md's layout table: {twice}"


TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml", ".sh", ".html", ".js"}
SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".ruff_cache", ".pytest_cache"}
MARKER = re.compile(r"^(<<<<<<<|>>>>>>>) ", re.M)


def _conflict_markers(root: Path) -> list[str]:
    """Files under ``root`` (the project's text files: sources, docs, CI) holding a line that
    a merge left as a conflict marker, ``<<<<<<< `` or ``>>>>>>> ``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)  # (not walked into)
        for name in sorted(files):
            path = Path(folder, name)
            rel = path.relative_to(root)
            if (path.suffix in TEXT_SUFFIXES or rel.parts[0] == ".ci") \
                    and MARKER.search(path.read_text(errors="replace")):
                found.append(str(rel))
    return found


def test_no_merge_conflict_markers():
    """A merge resolved by hand leaves no conflict marker behind: two README rows for one
    module between ``<<<<<<< HEAD`` and ``>>>>>>> branch`` read as a table still, so the other
    checks do not see them (two were committed so, in stops 60 and 61)."""
    assert not _conflict_markers(ROOT)


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """Control: a package breaking every limit is caught by each check."""
    bad = tmp_path / "badpkg"
    bad.mkdir()
    (bad / "a.py").write_text("from .b import x\nimport torch\n\n\ndef big(t, other):\n"
                              + "    t = t + 1\n" * 70
                              + "    torch._foreach_norm([t])\n    return other._secret\n")
    (bad / "b.py").write_text("from .a import big\nx = 1\n")
    (tmp_path / "README.md").write_text("| a |\n<<<<<<< HEAD\n| b |\n=======\n>>>>>>> fix-x\n")
    assert _conflict_markers(tmp_path) == ["README.md"]
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    for check in (test_sizes, test_private_torch_only_in_compat, test_no_foreign_private_reads,
                  test_no_import_cycle):
        with pytest.raises(AssertionError):
            check("badpkg")
