"""The suite's own CI rules (``conftest.py``), run in child pytest processes: with ``CI=true`` a
missing test dependency stops the run before any test, and a skip fails unless it says it
needs a device (or Python) the machine lacks; without ``CI`` both are ordinary skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ci import NEEDS_CUDA

TESTS = Path(__file__).resolve().parent

SKIPPING = f'''
import pytest


def test_skipped_for_no_declared_reason():
    pytest.skip("optional thing missing")


def test_skipped_for_want_of_a_device():
    pytest.skip("{NEEDS_CUDA}")
'''


def pytest_child(tmp_path: Path, *, ci: bool, hide: str | None = None):
    """``pytest`` on a two-test file with this suite's conftest as a plugin; ``hide`` makes
    that module unimportable in the child, as if it were not installed."""
    (tmp_path / "test_child.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    paths = [str(TESTS)]
    if hide:
        (tmp_path / "site").mkdir(exist_ok=True)
        (tmp_path / "site" / "sitecustomize.py").write_text(
            f"import sys\nsys.modules[{hide!r}] = None\n")
        paths.insert(0, str(tmp_path / "site"))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", str(tmp_path / "test_child.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_under_ci_an_undeclared_skip_fails_and_a_missing_device_does_not(tmp_path):
    r = pytest_child(tmp_path, ci=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 skipped" in r.stdout, r.stdout
    assert "skipped under CI=true, where nothing may be skipped: Skipped: optional thing " \
           "missing" in r.stdout


def test_without_ci_skips_are_skips(tmp_path):
    r = pytest_child(tmp_path, ci=False)
    assert r.returncode == 0 and "2 skipped" in r.stdout, r.stdout + r.stderr


def test_under_ci_a_missing_test_dependency_stops_the_run(tmp_path):
    """(Each optional module goes through the same check; one stands for them, a child
    pytest costs seconds.)"""
    r = pytest_child(tmp_path, ci=True, hide="transformers")
    assert r.returncode == 4, r.stdout + r.stderr  # a usage error: no test ran
    assert "ERROR: CI=true and transformers not installed: the tests that need them would be " \
           "skipped" in r.stderr, r.stderr
