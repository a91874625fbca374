"""Found by a fuzz of ``torch.compile``d training (compiled model, submodule, loss, training
step; aot_eager and inductor; fullgraph, dynamic, graph breaks; planted faults and healthy runs).

A forward-and-loss function compiled with ``fullgraph=True`` around the recorded model trains
without the recorder, but the recorder's hooks (run outside dynamo's graphs, so a graph break
at the model's call) make dynamo refuse it; its error quoted the hook's reason as just
"nanreplay's hook". It now says why the graph breaks there and what to compile instead."""

from __future__ import annotations

import compile_fuzz_found_models as M
import pytest
import torch
from torch import nn

from recorder import FlightRecorder

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train(out_dir=None):
    model = M.make_model()
    crit = nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def forward_loss(x, y):
        return crit(model(x), y)

    rec = None if out_dir is None else FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir)
    try:
        if rec is not None:
            rec.__enter__()
        for step in range(2):
            x, y = M.batch(step)
            opt.zero_grad()
            forward_loss(x, y).backward()
            opt.step()
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)


def test_fullgraph_function_around_the_recorded_model_says_what_to_compile(tmp_path):
    train()  # (without the recorder it compiles whole and trains)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        train(tmp_path)
    msg = str(info.value)
    assert "nanreplay's hook, which runs outside dynamo's graphs" in msg
    assert "torch.compile(model, fullgraph=True)" in msg
    assert not list(tmp_path.rglob("*.nan"))
