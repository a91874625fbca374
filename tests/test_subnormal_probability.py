"""A softmax probability that underflows into float32's subnormal range (5e-42: not 0, so the
loss is finite) and then goes through ``log``: log's derivative 1/p is past float32's maximum.
It read 'overflow ... rescale its inputs or compute it in float64'; the value that went wrong
is the probability, which log space (``log_softmax``) never makes."""

from __future__ import annotations

import copy

import pytest
import replay_models as R
import torch

from recorder import FlightRecorder, NonFiniteError
from replay import replay

K, ROW = 3, 6


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _mislabelled_out_of_scale(model, x: torch.Tensor, target: float = -95.0):
    """A record in the wrong unit and mislabelled: the class the model finds least likely, and
    the factor that puts its log-probability just below ``target`` (in float64, on a copy of
    the model, whose calls are not recorded)."""
    m = copy.deepcopy(model).double()
    s = 1.0
    with torch.no_grad():
        y = int(m(x.double() * 100).argmin())
        while s < 1e5:
            if torch.log_softmax(m(x.double() * s), -1)[y] < target:
                return y, s
            s *= 1.005
    raise AssertionError("no scale reaches the target")


def test_a_subnormal_softmax_probability_under_log_is_an_underflow(out_dir):
    torch.manual_seed(0)
    model, crit = R.make_mlp(), R.SoftmaxFocalLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_mlp"):
            for step in range(6):
                x, y = R.batch(step)
                if step == K:
                    y[ROW], scale = _mislabelled_out_of_scale(model, x[ROW])
                    x[ROW] *= scale
                opt.zero_grad()
                loss = crit(model(x), y)
                assert torch.isfinite(loss)  # log(5e-42) is -95: the loss is finite
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "backward")
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "LogBackward0", [ROW]), o
    assert rep["reproduced"] and rep["cause"] == "underflow", rep["hint"]
    assert "smallest normal number" in rep["hint"] and "log_softmax" in rep["hint"]
