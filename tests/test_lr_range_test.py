"""A hand-written learning-rate range test (torch-lr-finder's shape: the lr grows
exponentially until the loss is no longer finite, then the saved weights and optimizer state
are put back) run before the real training under the same ``FlightRecorder``.

Its divergence is the point of the test: run inside ``rec.paused()`` it is not
recorded, and the training after it is numbered from step 0; run recorded, the event the
restore closes says what happened and names ``paused``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

STEPS, K, ROW = 6, 4, 5


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), nn.MSELoss()


def _batches(plant: bool = False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * 8, 4, generator=g)
    y = x.sum(1, keepdim=True)
    if plant:  # one bad record in the real training's batch K
        x[K * 8 + ROW, 2] = float("nan")
    return list(zip(x.split(8), y.split(8)))


def _range_test(model, opt, crit, batches, start=1e-2, mult=10.0):
    """Returns the number of updates made before the loss stopped being finite."""
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    lr, updates = start, 0
    while True:
        x, y = batches[updates % len(batches)]
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        loss = crit(model(x), y)
        if not torch.isfinite(loss):
            break
        loss.backward()
        opt.step()
        lr, updates = lr * mult, updates + 1
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    return updates


def _train(model, opt, crit, batches):
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_paused_range_test_is_not_recorded_and_training_is_unchanged(tmp_path):
    model, opt, crit = _setup()
    bare_updates = _range_test(model, opt, crit, _batches())
    bare = _train(model, opt, crit, _batches())
    model, opt, crit = _setup()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
        with rec.paused():
            updates = _range_test(model, opt, crit, _batches())
        assert rec.step == 0  # (the range test's updates are no steps of the run)
        losses = _train(model, opt, crit, _batches())
    assert updates == bare_updates and 0 < updates < 20  # it did diverge
    assert losses == bare and all(map(math.isfinite, losses))  # bit-identical
    assert rec.step == STEPS and rec.event is None and list(tmp_path.glob("*.nan")) == []


def test_a_bad_batch_after_a_paused_range_test_is_an_event_at_its_training_step(tmp_path):
    model, opt, crit = _setup()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
            with rec.paused():
                _range_test(model, opt, crit, _batches())
            _train(model, opt, crit, _batches(plant=True))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (K, "input", [ROW])
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == K and rep["cause"] == "input"


def test_an_unpaused_range_test_says_what_stopped_and_how_to_pause(tmp_path):
    """Recorded, the range test's non-finite loss (no backward, then the restore) is an event
    at the training's first forward; its message says the loop rewound, and to pause."""
    model, opt, crit = _setup()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            updates = _range_test(model, opt, crit, _batches())
            _train(model, opt, crit, _batches())
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (updates, "loss", 0)
    msg = str(info.value)
    assert "went through no backward, and the weights were then written outside" in msg
    assert "with rec.paused():" in msg
