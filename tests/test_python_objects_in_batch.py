"""A batch holding a Python object (here a ``Tag`` in a dict batch, as collate functions of
real pipelines pass ids, paths or metadata objects along with the tensors).

Documented (guide, limitations): such objects are stored as their ``repr`` (200 characters)
with their type name, nothing is pickled; the event and ``--info`` work as for any bundle;
``nanreplay`` cannot rebuild that micro-batch and stops with a one-line error (exit 2);
``--strip batch`` removes the ``repr``s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from bundles import invoke_cli, one_error_line
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

MODEL_CODE = '''
import torch
from torch import nn


class Tag:
    """Metadata a collate function passes along; its repr is long on purpose."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Tag({self.name!r}, " + "x" * 300 + ")"


class TaggedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, batch):
        out = self.lin(batch["x"])
        return out.log() if batch["tag"].name == "bad" else out  # the planted bug


def make_model():
    return TaggedNet()
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory holding the model's module, on sys.path and the working dir."""
    root = tmp_path / "proj"
    root.mkdir()
    name = f"tagged_{tmp_path.name[-12:].replace('-', '_')}"
    (root / f"{name}.py").write_text(MODEL_CODE)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.chdir(root)
    yield root, name
    sys.modules.pop(name, None)


def record(root: Path, name: str) -> NonFiniteError:
    mod = __import__(name)
    torch.manual_seed(0)
    model = mod.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=root / "bundles",
                            factory=f"{name}:make_model"):
            for step in range(5):
                x, y = torch.randn(8, 4, generator=g).abs(), torch.randint(0, 3, (8,), generator=g)
                opt.zero_grad()
                batch = {"x": x, "tag": mod.Tag("bad" if step == 2 else "ok"), "n": step}
                crit(model(batch), y).backward()
                opt.step()
    return info.value


def test_the_object_is_kept_as_its_repr_and_the_replay_says_it_cannot_rebuild_it(project):
    root, name = project
    err = record(root, name)
    check_event(err.event, step=2, phase="forward", module="", call=0)
    meta, tensors = read_bundle(err.bundle_path)
    (mb,) = meta["micro_batches"]
    (args, kwargs) = mb["inputs"]["$list"]
    items = dict(args["$list"][0]["$dict"])
    tag = items["tag"]
    assert tag["$type"] == "Tag" and set(tag) == {"$repr", "$type"}
    assert tag["$repr"].startswith("Tag('bad', xxx") and len(tag["$repr"]) == 200
    assert items["n"] == 2 and items["x"] == {"$t": "batch/0/0"}
    assert "batch/0/0" in tensors

    info = invoke_cli("--info", err.bundle_path)  # reads the header only
    assert info.exit_code == 0 and "event      step 2, phase forward" in info.stdout

    line = one_error_line(invoke_cli(err.bundle_path))
    assert line.startswith("nanreplay: micro-batch 0 holds an input that cannot be rebuilt "
                           "(Tag Tag('bad', xxx"), line

    stripped = invoke_cli(err.bundle_path, "--strip", "batch", "-o", root / "share.nan")
    assert stripped.exit_code == 0, stripped.stdout + stripped.stderr
    smeta, stensors = read_bundle(root / "share.nan")
    assert "Tag(" not in json.dumps(smeta) and not any(k.startswith("batch/") for k in stensors)
