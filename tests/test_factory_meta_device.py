"""How the replay calls the factory (guide, "The factory"): first under ``torch.device("meta")``,
so that building a large model allocates nothing; if that call fails, or leaves plain tensor
attributes on the meta device, it calls it again normally. Either way the bundle's weights are
loaded and the toy bundle replays to its op.

The factories live in a module written under the working directory; each call notes the
device that a tensor created without a device lands on during the call.
"""

from __future__ import annotations

import sys
import uuid

import pytest
from bundles import TOY_REPORT, TOY_SOURCE, with_factory
from bundles import invoke_cli as run

FACTORIES = '''

import torch as _torch

CALLS = []


def _note():
    CALLS.append(_torch.empty(0).device.type)  # "meta" inside torch.device("meta")


def make_on_meta():
    """Builds on any device: called once, on meta."""
    _note()
    return Classifier()


def make_needs_data():
    """Reads a value while building (a data-dependent init): impossible on meta."""
    _note()
    gain = _torch.ones(1).sum().item()
    model = Classifier()
    assert gain == 1.0
    return model


class GainClassifier(Classifier):
    def __init__(self):
        super().__init__()
        self.gain = _torch.ones(1)  # a plain tensor attribute: neither parameter nor buffer

    def forward(self, x):
        return super().forward(x * self.gain)


def make_plain_attribute():
    """Builds on meta, but leaves ``gain`` there: the forward could not run with it."""
    _note()
    return GainClassifier()
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"meta_fact_{uuid.uuid4().hex[:12]}"
    root = tmp_path / "proj"
    root.mkdir()
    (root / f"{name}.py").write_text(TOY_SOURCE.read_text() + FACTORIES)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(root)
    yield root, name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("factory, calls", [
    ("make_on_meta", ["meta"]),
    ("make_needs_data", ["meta", "cpu"]),
    ("make_plain_attribute", ["meta", "cpu"]),
])
def test_factory_is_called_on_meta_first_and_again_only_when_it_must(project, toy, factory,
                                                                     calls):
    root, name = project
    bundle = with_factory(toy, root / "b.nan", f"{name}:{factory}")
    r = run(bundle)
    assert r.exit_code == 0, r.stdout + r.stderr
    lines = r.stdout.rstrip("\n").splitlines()
    assert lines[:2] == TOY_REPORT[:2] and lines[3:] == TOY_REPORT[3:], r.stdout
    assert lines[2].startswith(f"  source     {name}.py:"), lines[2]
    assert sys.modules[name].CALLS == calls
