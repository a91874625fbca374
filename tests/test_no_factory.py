"""End to end: a run recorded without ``factory=`` (a user's first try) still gets a report.
The replay rebuilds the model from its class called with no arguments when the recorder saw
that every argument has a default (and says so in a note), or, made of torch.nn's own modules
only, from the bundle's description of them (``test_stock_model``); when it cannot (no
defaults, a torch container of a user's module, defaults that build another model) nothing is
re-run, and the report says
what the recorder saw and which option to pass, with exit 1, not a bare error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rl_models as RL
import torch
from bundles import invoke_cli

import replay
from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def record(tmp_path, model) -> Path:
    """Three SGD steps of ``model`` (a value regression, recorded without a factory); in the
    third batch one sample's target is 1e20 (a reward without its scaling), whose squared
    error overflows float32 in the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = torch.nn.MSELoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for step in range(3):
                x, y = torch.randn(8, RL.OBS, generator=g), torch.randn(8, 1, generator=g)
                y[5] = 1e20 if step == 2 else y[5]
                opt.zero_grad()
                out = model(x)
                crit(out[1] if isinstance(out, tuple) else out, y).backward()
                opt.step()
    return info.value.bundle_path


def replay_json(bundle: Path) -> tuple[dict, int]:
    r = invoke_cli(bundle, "--json")
    return json.loads(r.stdout), r.exit_code


def test_a_class_with_defaults_is_rebuilt_and_the_step_re_run(tmp_path):
    rep, code = replay_json(record(tmp_path, RL.make_agent()))
    assert (rep["reproduced"], rep["not_rerun"], code) == (True, None, 0), rep
    assert (rep["origin"]["phase"], rep["origin"]["op"], rep["cause"]) == (
        "loss", "aten.mse_loss", "overflow"), rep["origin"]
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert note.startswith("the bundle names no model factory: the model was rebuilt as "
                           "rl_models:Agent() with its default arguments"), note


@pytest.mark.parametrize("model", [
    pytest.param(lambda: torch.nn.Sequential(RL.Critic(width=16)), id="nn.Sequential of a user's"),
    pytest.param(lambda: RL.Critic(width=16), id="other defaults")])
def test_a_model_its_class_cannot_rebuild_gets_the_recorders_report(tmp_path, model):
    rep, code = replay_json(record(tmp_path, model()))
    assert (rep["reproduced"], rep["not_rerun"], code) == (False, "factory not imported", 1)
    assert rep["event"]["step"] == 2 and rep["origin"]["phase"] == "loss"
    assert rep["origin"]["op"] is None and rep["cause"] is None
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert note.endswith("pass --factory MOD:FN (a function returning the model) to re-run "
                         "the step, or, where it is defined (a notebook), replay.replay(path, "
                         "factory=that_function)"), note
    assert "\n" not in note


def test_the_python_api_takes_the_models_class_itself(tmp_path):
    """A model class defined where no import reaches it (a notebook cell, here a function's
    local class) cannot be named by ``--factory``; ``replay.replay(path, factory=Net)`` from
    where it is defined re-runs the step and names the op."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(RL.OBS, 1)

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    bundle = record(tmp_path, Net())
    assert replay_json(bundle)[0]["not_rerun"] == "factory not imported"
    rep = replay.replay(bundle, factory=Net)
    assert (rep["reproduced"], rep["not_rerun"]) == (True, None), rep
    assert (rep["origin"]["phase"], rep["origin"]["op"], rep["cause"]) == (
        "loss", "aten.mse_loss", "overflow"), rep["origin"]


def test_an_input_event_read_from_the_batch_asks_for_no_factory(tmp_path):
    """A NaN in the batch is in the bundle: no model is needed to name it, so the note does
    not offer a re-run (before: "nothing was re-run: pass --factory" beside "reproduced")."""
    model = torch.nn.Sequential(torch.nn.Linear(RL.OBS, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path):
            for step in range(3):
                x, y = torch.randn(8, RL.OBS, generator=g), torch.randn(8, 1, generator=g)
                x[3, 1] = float("nan") if step == 2 else x[3, 1]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    rep, code = replay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["samples"], code) == (
        True, "input", [3], 0), rep
    [note] = [p for p in rep["problems"] if "no model factory" in p]
    assert note == ("the bundle names no model factory, and none is needed here: the values "
                    "are in the bundle's batch"), note
