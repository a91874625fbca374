"""Vision training recipes as timm and torchvision's reference scripts write them (LayerScale
on channels-last permutes, stochastic depth), recorded and replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vision_models as VM
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, factory: str, steps: int = 6, spike: tuple[int, float] | None = None,
           **kw):
    model = {"vision_models:make_convnext": VM.make_convnext,
             "vision_models:make_convnext_dead_last": VM.make_convnext_dead_last}[factory]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw):
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


def test_a_window_s_one_update_that_grew_the_weights_is_said_so(out_dir):
    """Re-run from a rewind copy, the lr spike's one update grew the weights: the hint said
    they grew 'over the updates of steps 3-3'."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "vision_models:make_convnext", spike=(3, 1e14), rewind=2)
    rep = nanreplay_json(info.value.bundle_path, "--try", "lr=0.05")
    assert rep["window"]["reproduced"] and rep["cause"] == "overflow", rep["window"]
    assert "x over the update of step 3, from where the rewind window" in rep["hint"], \
        rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_a_drop_path_of_rate_one_names_the_number_it_divides_by(out_dir):
    """A stochastic depth rate of 1 at the last block (a linear rule reaching drop_path_rate
    = 1): keep_prob = 0, the mask is all 0 and ``random_tensor.div_(keep_prob)`` is 0/0. The
    hint said to add an eps to the denominator (std + eps), which a Python number divisor
    has no place for; it now says the number is a setting and how timm guards it."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "vision_models:make_convnext_dead_last")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "drop"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"]) == ("drop", "aten.div_", True), o
    assert o["source"] == f"vision_models.py:{_line('random_tensor.div_(keep_prob)')}"
    assert "aten.div_ of 0 by the number 0 (0/0)" in rep["hint"], rep["hint"]
    assert "keep_prob > 0" in rep["hint"] and "std + eps" not in rep["hint"], rep["hint"]


def _line(text: str) -> int:
    lines = (HERE / "vision_models.py").read_text().splitlines()
    return next(i for i, s in enumerate(lines, 1) if text in s)
