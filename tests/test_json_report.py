"""``nanreplay --json`` against what docs/cli.md promises of it: every stable key present with
its documented type, for a handful of bundles (a reproduced forward event, a stripped copy that
is not re-run, a root module's event with a rewind window and a what-if); and one name for the
root module in every ``module`` field, ``""`` as in ``named_modules()``, never the text
report's ``<root>``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from bundles import EXAMPLES, invoke_cli, nanreplay_json
from json_report_models import LogNet

from recorder import FlightRecorder, NonFiniteError

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict, "array": list}


def stable_keys() -> dict[str, str]:
    """``key: type`` of the doc's "Stable keys" table."""
    text = DOC.read_text(encoding="utf-8").split("### Stable keys", 1)[1].split("###", 1)[0]
    keys = dict(re.findall(r"^\| `([\w.]+)` \| ([^|]+?) \|", text, re.M))
    assert {"format", "origin.module", "cause", "what_if"} <= set(keys)  # (the table was read)
    return keys


def check_documented(report: dict) -> None:
    for key, kind in stable_keys().items():
        value, found = report, True
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                found = False
                break
            value = value[part]
        if not found:
            assert "absent" in kind or value is None and "null" in kind, (key, kind)
            continue
        if value is None:
            assert "null" in kind, (key, kind)
            continue
        assert isinstance(value, TYPES[kind.split()[0]]), (key, kind, value)
        if kind.startswith("array of integers"):
            assert all(isinstance(v, int) for v in value), (key, value)


def module_fields(value, path: str = ""):
    """(path, value) of every ``module`` key in the report."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "module":
                yield f"{path}.{k}", v
            yield from module_fields(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from module_fields(v, f"{path}[{i}]")


def check_module_names(report: dict) -> None:
    for where, name in module_fields(report):
        assert name is None or isinstance(name, str) and "<root>" not in name, (where, name)


@pytest.fixture
def in_examples(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)


def test_the_toy_report_and_its_stripped_copy_are_as_documented(toy, tmp_path, in_examples):
    rep = nanreplay_json(toy)
    assert (rep["origin"]["module"], rep["cause"]) == ("norm", "invalid")
    check_documented(rep)
    check_module_names(rep)
    shared = tmp_path / "shared.nan"
    assert invoke_cli(toy, "--strip", "batch", "-o", str(shared)).exit_code == 0
    rep = nanreplay_json(shared, code=None)
    assert rep["not_rerun"] and rep["cause"] is None
    check_documented(rep)
    check_module_names(rep)


def test_a_root_event_with_a_window_and_a_try_names_the_root_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent)
    torch.manual_seed(0)
    model = LogNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as e:
        with FlightRecorder(model, opt, out_dir=tmp_path, rewind=2,
                            factory="json_report_models:LogNet"):
            for step in range(4):
                x = torch.randn(8, 4)
                if step == 2:
                    x[3, 0] = 7.0
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    rep = nanreplay_json(e.value.bundle_path, "--try", "lr=0.1x")
    assert (rep["origin"]["phase"], rep["origin"]["module"], rep["origin"]["op"],
            rep["origin"]["samples"], rep["cause"]) == ("forward", "", "aten.log", [3], "invalid")
    assert rep["event"]["module"] == "" and rep["window"]["first_non_finite"]["module"] == ""
    assert rep["what_if"][0]["origin"]["module"] == ""
    assert "<root>" in rep["event"]["detail"]  # (prose says it as the text report does)
    check_documented(rep)
    check_module_names(rep)
