"""Quantization-aware training recorded and replayed: the fake-quant observers' buffers start
at +-inf and their per-channel scales are resized from [1] at the first forward. The replay
refused every such bundle ('buffers/fc1.weight_fake_quant.scale has shape [32] in the bundle but
[1] in the model from the factory; the factory builds a different model')."""

from __future__ import annotations

import json

import pytest
import qat_models as Q
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

# (torch.ao.quantization is deprecated for torchao in torch 2.13, QAT code still uses it; its
# observers warn about their own reduce_range at construction, in the replay's factory too)
pytestmark = [pytest.mark.filterwarnings(
    "ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning")]

BAD_STEP, BAD_ROW = 12, 9


def _train(out_dir, bad: bool) -> None:
    torch.manual_seed(0)
    model = Q.make_qat()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = torch.nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory="qat_models:make_qat"):
        for step in range(20):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            if bad and step == BAD_STEP:
                x[BAD_ROW, 2] = float("nan")
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()


def test_a_healthy_qat_run_raises_no_event(out_dir):
    _train(out_dir, bad=False)  # (the observers' initial +-inf are buffers: no event)
    assert not list(out_dir.glob("*.nan"))


def test_a_bad_sample_in_qat_is_replayed_with_the_observers_as_they_ran(out_dir):
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, bad=True)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == \
        (BAD_STEP, "input", [BAD_ROW])
    res = invoke_cli(err.bundle_path, "--json", "--try", f"drop={BAD_ROW}")
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.stdout)
    assert rep["reproduced"] and rep["cause"] == "input" and rep["origin"]["samples"] == [BAD_ROW]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
    assert any("fc1.weight_fake_quant.scale [32] (the factory's [1])" in p
               for p in rep["problems"]), rep["problems"]
