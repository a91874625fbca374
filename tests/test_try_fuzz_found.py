"""Rewind and what-if bugs a fuzz of real training loops found (``rewind=N``, ``--try``).

An Adam run whose learning rate is 1e5 under a deep ReLU regressor: the first update throws the
weights off, the next step's gradients reach ~1e27, whose square overflows Adam's exp_avg_sq
while the weights stay finite (the recorder's ``state`` event at step 1). The rewind window
holds that step's batch, so the window re-runs it, checking the state as training did, and each
``--try`` is a verdict: a rate that keeps the gradients small is finite, a tenth of 1e5 is not.
"""

from __future__ import annotations

import json

import pytest
import torch
import try_fuzz_found_models as M
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def nanreplay(bundle, *tries: str) -> dict:
    res = invoke_cli(bundle, "--json", *[a for t in tries for a in ("--try", t)])
    assert res.exit_code in (0, 1), res.stderr
    return json.loads(res.stdout)


def diverging(out_dir, optimizer):
    """The regressor trained by ``optimizer`` at lr=1e5, recorded with a rewind window, to
    its event."""
    torch.manual_seed(0)
    model = M.make_deep_regressor()
    opt = optimizer(model.parameters(), lr=1e5)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="try_fuzz_found_models:make_deep_regressor"):
            for s in range(10):
                x, y = M.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def test_a_state_event_is_re_run_from_the_window_and_its_tries_get_verdicts(tmp_path):
    err = diverging(tmp_path, torch.optim.Adam)
    assert err.event["step"] == 1 and err.event["phase"] == "optimizer"
    assert "exp_avg_sq" in err.event["state"]["body.0.weight"]
    report = nanreplay(err.bundle_path, "lr=1e-4", "lr=0.1x")
    assert report["cause"] == "overflow" and report["reproduced"] is True
    assert report["not_rerun"] is None
    w = report["window"]
    assert w is not None and w["reproduced"] is True and w["steps"] == [0, 1]
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["state"]) == (1, "update", "exp_avg_sq")
    assert first["params"] == ["body.0.weight"]
    tries = {t["try"]: t for t in report["what_if"]}
    # (checked against the loop re-run without the recorder: 1e-4 keeps every value finite,
    # 1e4 still overflows exp_avg_sq at step 1)
    assert tries["lr=1e-4"]["finite"] is True and tries["lr=1e-4"]["inconclusive"] is False
    low = tries["lr=0.1x"]
    assert low["finite"] is False and low["inconclusive"] is False and low["event_step"] == 1
    assert low["origin"]["params"] == ["body.0.weight"] and low["origin"]["state"] == "exp_avg_sq"
    assert not any("not re-run" in p for p in report["problems"])


def test_most_of_the_batch_does_not_stand_out_in_a_feature(tmp_path):
    """RMSprop at lr=1e5 throws the weights off in one update: the MSE of 15 of the 16 samples
    overflows at step 1. Their standard normal features are the data's scale, not records out
    of it: the hint blamed them as standing out against the one row left."""
    err = diverging(tmp_path, torch.optim.RMSprop)
    assert (err.event["step"], err.event["phase"]) == (1, "loss")
    report = nanreplay(err.bundle_path)
    assert report["cause"] == "overflow" and report["origin"]["op"] == "aten.mse_loss"
    assert len(report["origin"]["samples"]) == 15
    assert "stand out" not in report["hint"]
    assert "lower the learning rate or clip the gradients" in report["hint"]
