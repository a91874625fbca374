"""An overflow made by samples whose data is out of scale with the rest of the batch (a label
in the wrong unit): the cause is the op's (``overflow``), but a wider type only hides the bad
record, so the hint names the samples and the tensor, and ``--try auto`` drops them."""

from __future__ import annotations

import json

import cause_models as C
import pytest
import replay_models as R
import torch
from click.testing import CliRunner
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.cli import main as cli

K, ROW = 3, 5


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_a_target_out_of_scale_names_its_samples_and_auto_drops_them(tmp_path):
    """A regression target of 1e30 (a unit conversion gone wrong) overflows the squared error
    in float32. The report said only "float64 holds it: compute it in float64", and
    ``--try auto`` proposed float64, lr and clip, never the sample: outliers were looked for
    in the model's inputs only, not in the loss's targets."""
    model = C.make_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="cause_models:make_regressor"):
            for step in range(6):
                x, _ = R.batch(step)
                y = x.sum(1)
                if step == K:
                    y[ROW] = 1e30
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json", "--try", "auto"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["samples"], rep["cause"]) == \
        ("loss", "<loss>", [ROW], "overflow"), json.dumps(rep, indent=1)
    assert f"sample(s) {ROW} of loss_args[1] reach 1e+30" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and f"--try drop={ROW}" in rep["hint"], rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries[f"drop={ROW}"]["finite"] is True, tries


def test_a_float64_try_whose_loss_float32_cannot_hold_says_so(tmp_path):
    """A count model with a log link (``PoissonNLLLoss(log_input=True)``: exp(eta) - y eta)
    gets one record in grams where the others are in kilograms: exp(eta) of that row is 8.7e109,
    beyond float32. ``--try auto`` drops the row (finite, loss 1.04) and tries float64, which
    held it and read "finite through step 3 (loss 2.713e+108)", as if float64 fixed the run: a
    float32 run with that loss still overflows, and the line now says so."""
    model = C.make_count_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    crit = nn.PoissonNLLLoss(log_input=True)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="cause_models:make_count_model") as rec:
            for step in range(6):
                x = torch.rand(32, 8, generator=g)
                y = torch.poisson(torch.full((32, 1), 2.0), generator=g)
                if step == K:
                    x[6] *= 1000.0
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    path = str(info.value.bundle_path)
    rep = json.loads(CliRunner().invoke(cli, [path, "--json", "--try", "auto"]).stdout)
    assert (rep["origin"]["op"], rep["origin"]["samples"], rep["cause"]) == \
        ("aten.exp", [6], "overflow"), json.dumps(rep, indent=1)
    tries = {t["try"]: t for t in rep["what_if"]}
    wide, drop = tries["dtype=float64"], tries["drop=6"]
    assert wide["finite"] is True and wide["loss"] > 3.4e38 and wide["beyond"] == "float32"
    assert drop["finite"] is True and drop["loss"] < 10 and drop["beyond"] is None
    text = CliRunner().invoke(cli, [path, "--try", "auto"]).stdout
    line = next(t for t in text.splitlines() if "what-if    dtype=float64" in t)
    assert "beyond float32's range: a float32 run still overflows" in line, line
