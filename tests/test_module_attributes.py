"""Plain attributes the loop changes during training (a Gumbel-softmax temperature annealed
to 0, a scheduled dropout probability): the factory builds them as they started, so the replay
re-ran the step with the factory's values and said NOT reproduced, sending the user to look for
state outside the model. The bundle now keeps each module's int, float and bool attributes and
the replay sets the recorded ones it differs from, saying so."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.attributes import AttributeWatch
from recorder.bundle import read_bundle
from recorder.compiled import hook_sites
from replay.attributes import restore_attributes
from replay.cli import main as cli

pytestmark = pytest.mark.usefixtures("in_tests_dir")


class TemperatureSoftmax(nn.Module):
    """Codes as a softmax at temperature ``tau``, which the loop anneals."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.0)
        self.dec = nn.Linear(16, 8)
        self.tau = 1.0

    def forward(self, x):
        return self.dec(self.drop(torch.softmax(self.enc(x) / self.tau, dim=-1)))


def test_a_temperature_annealed_to_zero_by_the_loop_is_replayed_and_named(out_dir):
    """A linear schedule sets ``model.tau`` to 0 at step 5: ``logits / tau`` is +-inf and the
    softmax NaN. The replay sets tau (and the scheduled dropout p) as the run had them and
    names the division, at the user's line, as a pole."""
    model = TemperatureSoftmax()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="test_module_attributes:TemperatureSoftmax"):
            for step in range(10):
                model.tau = max(0.0, 1.0 - step * 0.2)
                model.drop.p = 0.5 if step >= 2 else 0.0
                x = torch.randn(4, 8, generator=g)
                opt.zero_grad()
                crit(model(x), x).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (5, "forward", ""), ev
    # only what the loop changed after attach: the factory's own values (enc.in_features,
    # drop.inplace) are its to build, and a difference there is the fidelity check's to report
    meta, _ = read_bundle(info.value.bundle_path)
    attrs = {m["name"]: m["attrs"] for m in meta["modules"] if "attrs" in m}
    assert attrs == {"": {"tau": 0.0}, "drop": {"p": 0.5}}, attrs
    res = CliRunner().invoke(cli, [str(info.value.bundle_path), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["module"], o["op"], rep["cause"]) == ("", "aten.div", "invalid"), rep
    note = next(p for p in rep["problems"] if "attributes" in p)
    assert "<root>.tau = 0.0 (the factory built 1.0)" in note, note
    assert "drop.p = 0.5 (the factory built 0.0)" in note, note


def test_a_bundle_sets_only_attributes_the_model_has_of_the_same_type():
    """The bundle is untrusted input: an attribute the rebuilt module lacks, one of another
    type, a value of a type not recorded, or a module the model lacks is left alone."""
    model = TemperatureSoftmax()
    meta = {"modules": [
        {"name": "", "attrs": {"tau": 0.5, "missing": 3, "training": False}},
        # p: an int for a float, the same number (a schedule of ints), set as the float 1.0
        {"name": "drop", "attrs": {"p": 1, "inplace": True}},
        {"name": "nowhere", "attrs": {"tau": 2.0}},
        # a float for an int (another number) and a list: left alone
        {"name": "enc", "attrs": {"in_features": [1, 2], "out_features": 2.5}},
    ]}
    restored = restore_attributes(meta, model)
    assert restored == ["<root>.tau = 0.5 (the factory built 1.0)",
                        "drop.p = 1.0 (the factory built 0.0)",
                        "drop.inplace = True (the factory built False)"], restored
    assert (model.tau, model.drop.p, model.enc.in_features) == (0.5, 1.0, 8)
    assert type(model.drop.p) is float and type(model.enc.out_features) is int
    assert not hasattr(model, "missing") and model.training is True


def test_attributes_are_bundled_as_the_step_found_them():
    """The forward may change an attribute itself (a rotary cache's length, grown in the step):
    the value the step began with goes with the buffers as the step found them. One deleted
    after attach, or added after it, is taken as the step closed; a module added after attach
    has no start to differ from."""
    model = TemperatureSoftmax()
    watch = AttributeWatch(hook_sites(model))
    model.tau = 0.5
    watch.step_started()
    model.tau, model.drop.p = 0.25, 0.1  # in the step
    model.fresh = 3
    assert watch.changed("", model) == {"tau": 0.5, "fresh": 3}
    assert watch.changed("drop", model.drop) == {}
    del model.drop.inplace
    watch.step_started()
    assert watch.changed("drop", model.drop) == {"p": 0.1}
    assert watch.changed("added", nn.Linear(2, 2)) == {}
