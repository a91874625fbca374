"""Vision training recipes as timm and torchvision's reference scripts write them (LayerScale
on channels-last permutes, stochastic depth), recorded and replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import vision_models as VM
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)


def nanreplay_json(bundle, *args: str) -> dict:
    r = invoke_cli(bundle, "--json", *args)
    assert r.exit_code in (0, 1) and r.stderr == "", (r.exit_code, r.stderr)
    return json.loads(r.stdout)


def _train(out_dir, factory: str, steps: int = 6, spike: tuple[int, float] | None = None):
    model = {"vision_models:make_convnext": VM.make_convnext,
             "vision_models:make_convnext_dead_last": VM.make_convnext_dead_last}[factory]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory):
        for step in range(steps):
            x, y = VM.batch(step)
            if spike is not None and step == spike[0]:
                opt.param_groups[0]["lr"] = spike[1]
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()


def test_a_healthy_convnext_run_raises_nothing(out_dir):
    _train(out_dir, "vision_models:make_convnext")


def test_an_overflow_after_a_permute_back_to_nchw_is_the_pool_s(out_dir):
    """An lr spike makes the LayerScale's NHWC output large but finite; permuted back to NCHW
    it is a view the recorder measured again with a float32 sum, which overflowed: the pool
    that made the +Inf seemed to take non-finite inputs, the event named '<root>' and the
    replay (the pool's aten.mean) said NOT reproduced."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "vision_models:make_convnext", spike=(3, 1e14))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (4, "forward", "pool"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"], rep
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("pool", "aten.mean")
    assert rep["cause"] == "overflow"
    assert "learning rate had jumped at step 3" in rep["hint"], rep["hint"]
