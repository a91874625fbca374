"""A model class of a training script run under multiprocessing's spawn: the child runs the
script as ``__mp_main__`` (``runpy.run_path(script, run_name="__mp_main__")``, as
``multiprocessing.spawn`` does, run here in this process to keep the test fast), so the bundle
records ``__mp_main__.Net``. A class whose ``__init__`` takes arguments cannot be rebuilt bare:
the note named no module to pass (the generic "--factory MOD:FN"); it now names the script's,
and that ``--factory`` re-runs the step."""

from __future__ import annotations

import runpy
import sys

import pytest
from bundles import nanreplay_json

from recorder import NonFiniteError

K, ROW = 2, 3

SCRIPT = f'''
import torch
from torch import nn
from recorder import FlightRecorder


class Net(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 1)

    def forward(self, x):
        return self.fc(x / x.norm(dim=1, keepdim=True))  # the bug: a blank record's norm is 0


def make():
    return Net(4)


def train(out_dir):
    torch.manual_seed(0)
    model = Net(4)
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        for step in range(4):
            x, y = torch.randn(5, 4), torch.randn(5, 1)
            if step == {K}:
                x[{ROW}] = 0
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(train, args=("bundles",))
'''


def test_a_spawned_scripts_class_with_arguments_names_the_factory_to_pass(tmp_path,
                                                                          monkeypatch):
    script = tmp_path / "train_spawned.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script.name])  # (the child's command line: the script)
    child = runpy.run_path(str(script), run_name="__mp_main__")
    with pytest.raises(NonFiniteError) as info:
        child["train"](tmp_path / "bundles")
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "forward")
    rep = nanreplay_json(err.bundle_path, code=None)
    assert not rep["reproduced"], rep
    note = next(p for p in rep["problems"] if p.startswith("the bundle names no model factory"))
    assert "defined in the script train_spawned.py, run as __mp_main__" in note, note
    assert "pass --factory train_spawned:FN, a function in train_spawned.py" in note
    # the advice works: the script's make() rebuilds the model and the step re-runs
    rep = nanreplay_json(err.bundle_path, "--factory", "train_spawned:make")
    assert rep["reproduced"] and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["samples"]) == (
        K, "", "aten.div", [ROW])
    line = next(i for i, t in enumerate(SCRIPT.splitlines(), 1) if "the bug" in t)
    assert o["source"] == f"train_spawned.py:{line}"
