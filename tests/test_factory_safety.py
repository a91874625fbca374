"""A bundle never makes nanreplay import or call anything by itself.

The recorded factory is used only when it resolves to a module under the current working
directory, or when it is passed with ``--factory``; otherwise the report says which option to
pass (exit 1). Each factory module here is the toy model's code plus a line that leaves a marker
file when the module is imported, so "not imported" is checked on disk and in ``sys.modules``.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from bundles import factory_module, with_factory, with_precursor
from bundles import invoke_cli as run


class Factory:
    """``<dir>/<name>.py`` building the toy model; ``marker`` appears when it is imported."""

    def __init__(self, root: Path, toy: Path):
        self.name = f"fact_{uuid.uuid4().hex[:12]}"
        self.spec = f"{self.name}:make_model"
        self.dir = root / "code"
        self.marker = root / "marker"
        factory_module(self.dir, self.name, self.marker)
        self.bundle = with_factory(toy, root / "bundles" / "b.nan", self.spec)

    @property
    def imported(self) -> bool:
        assert self.marker.exists() == (self.name in sys.modules)
        return self.marker.exists()


@pytest.fixture
def fac(tmp_path, toy, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    f = Factory(tmp_path, toy)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the factory's directory unless a test moves
    yield f
    sys.modules.pop(f.name, None)


def refusal(spec: str) -> str:
    return (f"the bundle's factory {spec!r} is not a module under the current directory "
            f"({Path.cwd()}); nanreplay imports a recorded factory only from there. Run from "
            f"the directory that holds the factory's module, or pass --factory {spec} to trust it")


def test_factory_outside_cwd_is_not_imported_and_the_report_names_the_option(fac):
    r = run(fac.bundle)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == "nanreplay: step 37, forward event — not re-run (factory not imported)"
    assert "  origin     forward: nan made by norm, call 0, inputs finite" in lines
    assert f"  note       {refusal(fac.spec)}" in lines
    assert not fac.imported


@pytest.mark.parametrize("on_path", [False, True], ids=["not-on-sys.path", "on-sys.path"])
def test_factory_outside_cwd_is_never_imported(fac, monkeypatch, on_path):
    if on_path:
        monkeypatch.syspath_prepend(str(fac.dir))
    r = run(fac.bundle)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"  note       {refusal(fac.spec)}" in r.stdout.splitlines()
    j = run("--json", fac.bundle)
    assert j.exit_code == 1
    assert refusal(fac.spec) in json.loads(j.stdout)["problems"]
    i = run("--info", fac.bundle)
    assert i.exit_code == 0
    assert f"factory {fac.spec}" in i.stdout
    assert not fac.imported


def test_json_report_of_a_refused_factory(fac):
    r = run("--json", fac.bundle)
    assert r.exit_code == 1
    d = json.loads(r.stdout)
    assert d["reproduced"] is False
    assert refusal(fac.spec) in d["problems"]
    assert (d["event"]["step"], d["event"]["module"]) == (37, "norm")
    assert not fac.imported


def test_refused_factory_still_reports_the_ring_buffer(fac, tmp_path):
    b = with_precursor(fac.bundle, tmp_path / "jump.nan", step=30)
    r = run(b)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert "  precursors" in lines
    assert any(line.startswith("    step     30  loss_jump") for line in lines)
    assert not fac.imported


def test_factory_under_cwd_is_used(fac, monkeypatch):
    monkeypatch.chdir(fac.dir)
    r = run(fac.bundle)
    assert r.exit_code == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "nanreplay: step 37, forward event — reproduced"
    assert lines[1] == "  origin     forward: nan made by aten.div in norm, call 0, inputs finite"
    assert lines[2].startswith(f"  source     {fac.name}.py:")
    assert fac.imported


def test_factory_in_a_package_under_cwd_is_used(fac, monkeypatch, tmp_path, toy):
    pkg = f"proj_{uuid.uuid4().hex[:12]}"
    inner = Factory(tmp_path / "pkgroot", toy)
    (inner.dir / "__init__.py").write_text("")
    inner.dir.rename(tmp_path / "pkgroot" / pkg)
    monkeypatch.chdir(tmp_path / "pkgroot")
    b = with_factory(inner.bundle, tmp_path / "pkg.nan", f"{pkg}.{inner.spec}")
    try:
        r = run(b)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert inner.marker.exists()
    finally:
        sys.modules.pop(f"{pkg}.{inner.name}", None)
        sys.modules.pop(pkg, None)


def test_recorded_factory_named_like_a_stdlib_module_is_refused(fac, monkeypatch, tmp_path):
    """``code`` is the standard library's module, already imported from outside cwd: a
    ``./code/`` directory does not make ``code.x:make`` trusted."""
    root = tmp_path / "stdlib-name"
    (root / "code").mkdir(parents=True)
    (root / "code" / "anything.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.chdir(root)
    spec = "code.anything:make_model"
    r = run(with_factory(fac.bundle, root / "sub.nan", spec))
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"  note       {refusal(spec)}" in r.stdout.splitlines()


def test_factory_option_is_trusted_from_anywhere(fac, monkeypatch):
    monkeypatch.syspath_prepend(str(fac.dir))
    r = run("--factory", fac.spec, fac.bundle)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[1] == ("  origin     forward: nan made by aten.div in norm, "
                                        "call 0, inputs finite")
    assert fac.imported


def test_factory_option_overrides_the_recorded_one(fac, tmp_path, toy, monkeypatch):
    """The bundle names one module, the user trusts another: only the user's is imported."""
    other = Factory(tmp_path / "other", toy)
    monkeypatch.syspath_prepend(str(fac.dir))
    monkeypatch.syspath_prepend(str(other.dir))
    try:
        r = run("--factory", other.spec, fac.bundle)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert other.imported
        assert not fac.imported
    finally:
        sys.modules.pop(other.name, None)


@pytest.mark.parametrize("spec", ["os:getcwd", "json:loads", "builtins:exec", "shutil:rmtree"])
def test_recorded_library_factory_is_refused(fac, tmp_path, spec):
    """Modules already imported from outside cwd (stdlib, builtins) are not trusted either."""
    b = with_factory(fac.bundle, tmp_path / "lib.nan", spec)
    r = run(b)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"  note       {refusal(spec)}" in r.stdout.splitlines()


@pytest.mark.parametrize("spec", ["__hello__:main", "xxsubtype:spamdict"])
def test_recorded_frozen_or_builtin_module_is_refused(fac, tmp_path, spec):
    """Frozen and built-in modules not imported yet have an origin ('frozen', 'built-in') that
    is not a file: it must not count as 'under the current directory'."""
    mod = spec.partition(":")[0]
    assert mod not in sys.modules
    b = with_factory(fac.bundle, tmp_path / "frozen.nan", spec)
    try:
        r = run(b)
        assert r.exit_code == 1, r.stdout + r.stderr
        assert f"  note       {refusal(spec)}" in r.stdout.splitlines()
        assert "Hello world!" not in r.stdout
        assert mod not in sys.modules
    finally:
        sys.modules.pop(mod, None)


def test_recorded_attribute_path_out_of_the_module_under_cwd_is_not_called(fac, tmp_path,
                                                                            monkeypatch):
    """``mod:helper.make`` where ``mod`` is under cwd but ``helper`` is code from elsewhere that
    ``mod`` imported: the module is trusted, the function it leads to is not."""
    outside = tmp_path / "site"
    outside.mkdir()
    helper = f"helper_{uuid.uuid4().hex[:12]}"
    called = tmp_path / "called"
    (outside / f"{helper}.py").write_text(
        f"from pathlib import Path\n\ndef make():\n    Path({str(called)!r}).write_text('x')\n")
    (fac.dir / f"{fac.name}_uses.py").write_text(f"import {helper}\n")
    monkeypatch.syspath_prepend(str(outside))
    monkeypatch.chdir(fac.dir)
    spec = f"{fac.name}_uses:{helper}.make"
    try:
        r = run(with_factory(fac.bundle, tmp_path / "attr.nan", spec))
        assert r.exit_code == 1, r.stdout + r.stderr
        assert f"  note       the bundle's factory {spec!r} is {helper}.make, which is not " \
            f"defined under the current directory ({fac.dir}); nanreplay calls a recorded " \
            f"factory only from there. Pass --factory {spec} to trust it" in r.stdout.splitlines()
        assert not called.exists()
    finally:
        sys.modules.pop(f"{fac.name}_uses", None)
        sys.modules.pop(helper, None)


def test_recorded_attribute_path_to_a_builtin_is_not_called(fac, monkeypatch, tmp_path):
    """``os.getpid`` reached through torch, itself reached through the trusted module."""
    monkeypatch.chdir(fac.dir)
    spec = f"{fac.name}:torch.os.getpid"
    r = run(with_factory(fac.bundle, tmp_path / "pid.nan", spec))
    assert r.exit_code == 1, r.stdout + r.stderr
    assert f"the bundle's factory {spec!r} is posix.getpid, which is not defined under the " \
        "current directory" in r.stdout


@pytest.mark.parametrize("cwd", ["project", "elsewhere"])
def test_info_imports_nothing(fac, monkeypatch, cwd):
    if cwd == "project":
        monkeypatch.chdir(fac.dir)
    for args in (("--info",), ("--info", "--json")):
        r = run(*args, fac.bundle)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert fac.spec in r.stdout
    assert not fac.imported


def test_strip_imports_nothing(fac, monkeypatch, tmp_path):
    monkeypatch.chdir(fac.dir)
    r = run("--strip", "batch", "--strip", "weights", "-o", tmp_path / "s.nan", fac.bundle)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert not fac.imported


def test_weight_stripped_copy_imports_nothing_even_from_cwd(fac, monkeypatch, tmp_path):
    monkeypatch.chdir(fac.dir)
    out = tmp_path / "s.nan"
    assert run("--strip", "weights", "-o", out, fac.bundle).exit_code == 0
    r = run(out)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert not fac.imported


def _replay_process(bundle: Path, cwd: Path, *args: str):
    """``python -m replay BUNDLE ARGS`` in a process of its own: its ``sys.argv`` is
    nanreplay's, as when a user runs it (the click runner leaves pytest's)."""
    import os
    import subprocess

    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    return subprocess.run([sys.executable, "-m", "replay", str(bundle), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def _recorded_with(src: Path, dst: Path, factory: str, argv: list[str]) -> Path:
    """``src`` naming ``factory``, recorded by the command line ``argv``."""
    from bundles import rewrite

    def edit(m):
        m["factory"] = factory
        m["env"]["argv"] = argv
        return m

    return rewrite(src, dst, meta=edit)


def test_a_factory_module_that_parses_the_command_line_at_import_sees_the_recorded_one(
        tmp_path, toy):
    """A training module with a module-level ``parser.parse_args()`` (its training under the
    main guard): importing it read nanreplay's own argv (the bundle path, --json) and died
    with the script's usage message, exit 2; now it parses the command line the run had."""
    code = tmp_path / "code"
    factory_module(code, "train_args", tmp_path / "marker")
    src = (code / "train_args.py").read_text()
    (code / "train_args.py").write_text(
        "import argparse\n_p = argparse.ArgumentParser()\n_p.add_argument('--lr', type=float, "
        "default=0.1)\nARGS = _p.parse_args()\n" + src)
    bundle = _recorded_with(toy, tmp_path / "b.nan", "train_args:make_model",
                            ["train_args.py", "--lr", "0.01"])
    r = _replay_process(bundle, code, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["reproduced"], rep["origin"]["module"], rep["origin"]["op"], rep["cause"]) == \
        (True, "norm", "aten.div", "invalid")


def test_a_factory_module_that_exits_at_import_is_a_one_line_error(tmp_path, toy):
    """``sys.exit(...)`` when the module is imported (a config check at module level) ended
    nanreplay with the user's message and no word of its own; now one nanreplay line, exit 2."""
    code = tmp_path / "code"
    factory_module(code, "train_exit", tmp_path / "marker")
    src = (code / "train_exit.py").read_text()
    (code / "train_exit.py").write_text(src + "\nimport sys\nsys.exit(3)\n")
    bundle = _recorded_with(toy, tmp_path / "b.nan", "train_exit:make_model",
                            ["train_exit.py"])
    r = _replay_process(bundle, code)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        "nanreplay: factory 'train_exit:make_model': the code it imports or calls exited "
        "(SystemExit(3)) with the recorded command line ['train_exit.py']; move what "
        "parses the command line or exits under `if __name__ == \"__main__\":`, or pass "
        "--factory MOD:FN of a module that does neither when imported"], r.stderr


def test_a_factory_module_that_trains_at_import_is_stopped_at_its_recorder(tmp_path, toy):
    """A training script with its loop at module level (no main guard), named as the factory:
    importing it re-ran the whole training with the recorded command line, which wrote a bundle
    of its own beside the user's, before the replay went on. Its FlightRecorder now refuses to
    be built while nanreplay imports the module: one nanreplay line, exit 2, nothing trained."""
    code = tmp_path / "code"
    factory_module(code, "train_top", tmp_path / "marker")
    src = (code / "train_top.py").read_text()
    (code / "train_top.py").write_text(src + (
        "\nfrom recorder import FlightRecorder\n_m = make_model()\n"
        "_opt = torch.optim.SGD(_m.parameters(), lr=0.1)\n"
        "with FlightRecorder(_m, _opt, out_dir='again'):\n"
        "    for _ in range(3):\n"
        "        _opt.zero_grad()\n"
        "        _m(torch.full((8, 16), float('nan'))).sum().backward()\n"
        "        _opt.step()\n"))
    bundle = _recorded_with(toy, tmp_path / "b.nan", "train_top:make_model", ["train_top.py"])
    r = _replay_process(bundle, code)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        "nanreplay: factory 'train_top:make_model': importing train_top runs its training (a "
        "FlightRecorder is built at import), which nanreplay stopped there; put the training "
        "under `if __name__ == \"__main__\":`, or pass --factory MOD:FN of a module that only "
        "builds the model"], r.stderr
    assert not (code / "again").exists()


def test_a_factory_in_a_directory_an_installed_package_shadows_says_how_to_import_it(
        tmp_path, monkeypatch):
    """``--factory examples.toy_model:make_model`` from the repository root, where an installed
    regular package ``examples`` (opacus installs one) wins over ./examples/, which has no
    ``__init__.py``: the error names the installed one and the spec to pass from inside."""
    from replay.errors import ReplayError
    from replay.factory import resolve_factory
    name = f"shadowed_{uuid.uuid4().hex[:8]}"
    site = tmp_path / "site"
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    cwd = tmp_path / "repo"
    (cwd / name).mkdir(parents=True)
    (cwd / name / "toy.py").write_text("def make_model():\n    return None\n")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    monkeypatch.chdir(cwd)
    try:
        with pytest.raises(ReplayError) as err:
            resolve_factory(f"{name}.toy:make_model", explicit=True)
    finally:
        sys.modules.pop(name, None)
    msg = str(err.value)
    assert f"the {name!r} imported is {site / name}" in msg, msg
    assert f"run from {cwd / name} and pass --factory toy:make_model" in msg, msg
