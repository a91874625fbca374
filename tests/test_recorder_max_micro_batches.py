"""``max_micro_batches``: a step with an optimizer whose ``step()`` never comes (a loop that
only accumulates, a forward-only probe with gradients on) is closed when it reaches that many
root forwards, so the recorder never holds more than that many batches.

Documented (guide, "What a step is"): "A step is also closed when it reaches
``max_micro_batches`` (1024) root forwards."
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import replay_models as R
import torch
from models import check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

HERE = Path(__file__).parent
LIMIT = 3


def test_a_step_closes_at_max_micro_batches_and_lets_its_batches_go(out_dir):
    model, crit = R.make_log_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, alive = [], []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        max_micro_batches=LIMIT) as rec:
        for i in range(2 * LIMIT + 1):  # forwards and backwards, never opt.step()
            x, y = R.batch(i)
            alive.append(weakref.ref(x))
            crit(model(x), y).backward()
            del x, y
            gc.collect()
            steps.append((rec.step, [r() is not None for r in alive]))
    # forwards 0-2 are step 0; the fourth forward closes it (its three batches are let go)
    assert [s for s, _ in steps] == [0, 0, 0, 1, 1, 1, 2]
    assert steps[3][1] == [False, False, False, True]
    assert steps[6][1] == [False] * 6 + [True]
    assert rec.event is None and rec.step == 3  # the with block closed the last one


def test_an_event_in_such_a_step_names_its_micro_batch_and_replays(out_dir, monkeypatch):
    model, crit = R.make_log_net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forwards = 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, max_micro_batches=LIMIT,
                            factory="replay_models:make_log_net"):
            for i in range(3 * LIMIT):
                x, y = R.batch(i)
                if i == LIMIT + 1:  # step 1, micro-batch 1
                    x[5] *= 100.0
                forwards += 1
                crit(model(x), y).backward()
    assert forwards == 2 * LIMIT + 1  # raised when the next forward closed step 1
    check_event(info.value.event, step=1, phase="forward", module="act", call=0,
                micro_batch=1, samples=[5])
    monkeypatch.chdir(HERE)
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == 1 and rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["module"], o["call"], o["micro_batch"], o["op"], o["samples"]) == \
        ("act", 0, 1, "aten.log", [5])
