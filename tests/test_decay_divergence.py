"""An optimizer's own weight decay as the cause of a divergence: with |1 - lr * wd| above 1
(a decoupled decay's factor) or SGD's coupled term past its bound, every update grows the
weights whatever the gradients were, and with them the gradients, Adam's exp_avg_sq or the
momentum buffer. The hint said to find what made the gradients large and clip them, and
``--try auto`` did not propose wd=0, where the decay ran in a kernel no op watcher sees (a
fused AdamW) or the event was the update's own (no growth hint)."""

from __future__ import annotations

from types import SimpleNamespace

import decay_divergence_models as DD
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.decay_divergence import decay_growth

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, classes: bool, make_opt, epochs: int = 20) -> NonFiniteError:
    model = DD.make_classifier() if classes else DD.make_regressor()
    opt = make_opt(model)
    crit = nn.CrossEntropyLoss() if classes else nn.MSELoss()
    x, y = DD.data(classes)
    factory = "decay_divergence_models:" + ("make_classifier" if classes else "make_regressor")
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory,
                            rewind=4):
            for _ in range(epochs):
                for i in range(0, len(x), 32):
                    opt.zero_grad()
                    crit(model(x[i:i + 32]), y[i:i + 32]).backward()
                    opt.step()
    return info.value


def test_fused_adamws_decay_factor_is_named_and_auto_tries_wd_0(out_dir):
    """AdamW(fused=True) at lr=1, weight_decay=1e3: p *= -999 inside the fused kernel, the
    gradients grow with the weights until exp_avg_sq overflows (a state event at step 3). The
    hint said 'find what made the gradients that large' with no word of the decay, and auto
    proposed no wd=0 (the window's op watcher never sees a fused kernel's product)."""
    err = _train(out_dir, False, lambda m: torch.optim.AdamW(
        m.parameters(), lr=1.0, weight_decay=1e3, fused=True))
    assert (err.event["step"], err.event["phase"]) == (3, "optimizer")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["cause"] == "overflow" and rep["origin"]["param"] == "body.0.weight"
    assert "weight_decay=1e+03" in rep["hint"] and "lr * weight_decay 1e+03" in rep["hint"]
    assert "multiplies body.0.weight by -999" in rep["hint"], rep["hint"]
    assert rep["weight_decay"]["factor"] == pytest.approx(-999.0, rel=1e-4)
    tries = {t["try"]: t for t in rep["what_if"]}
    # (and the rate at which lr * weight_decay is 0.1: 0.1x of it leaves 100, still diverging)
    assert tries["wd=0"]["finite"] is True and tries["lr=0.0001"]["finite"] is True, tries


def test_sgd_coupled_decay_named_at_an_update_that_overflowed(out_dir):
    """SGD(lr=0.01, momentum=0.9, weight_decay=1e3): lr * wd = 10 is past the 3.8 where the
    heavy-ball iteration of the decay term alone diverges; with a tanh classifier the
    gradients stay bounded and the update itself overflows the weights. The hint, an
    update's ('check the learning rate and schedule, and clip gradients'), named no decay."""
    err = _train(out_dir, True, lambda m: torch.optim.SGD(
        m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e3))
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert (err.event["step"], err.event["phase"]) == (40, "optimizer")
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["param"], o["op"]) == \
        ("optimizer", "optimizer", "body.0.weight", "aten.add"), rep["hint"]
    assert "SGD's weight_decay=1e+03 at lr=0.01, momentum 0.9 makes lr * weight_decay 10" \
        in rep["hint"], rep["hint"]
    assert rep["weight_decay"]["kind"] == "coupled"
    # (lr=0.1x leaves lr * weight_decay at 1, the heavy ball stable: no rate of its own)
    assert [t["try"] for t in rep["what_if"]] == ["lr=0.1x", "clip=1.0", "wd=0"]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=5.0, weight_decay=1e-4),  # coupled, normalised by v
    lambda p: torch.optim.SGD(p, lr=0.03, momentum=0.9, weight_decay=100.0),  # 3 < 3.8
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
], ids=["adam-coupled", "sgd-stable", "adamw-usual"])
def test_a_decay_that_shrinks_or_no_single_factor_is_not_blamed(make_opt):
    """The probe reads the update rule: Adam's coupled decay through exp_avg_sq moves each
    entry by about lr whatever its size (no single factor), SGD's heavy ball at lr * wd = 3
    with momentum 0.9 and AdamW's usual 1 - 1e-5 shrink the weights."""
    model = DD.make_regressor()
    opt = make_opt(model.parameters())
    step = SimpleNamespace(optimizer=opt, model=model, meta={}, event={})
    assert decay_growth(step, {}) is None
