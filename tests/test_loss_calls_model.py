"""A loss that runs the model itself (sentence-transformers' ``Loss(model)``): the re-run's
gradients are the step's, whether the loss calls the model once or twice. With two calls the
re-run added the recorded output gradients of both forwards to the loss's own backward, which
already went through them: gradients off by up to 20 % per entry."""

from __future__ import annotations

import loss_calls_model_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from replay.load import read_step
from replay.rebuild import build
from replay.rerun import Runner

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.mark.parametrize("make", ["make_one_call", "make_two_calls"])
def test_rerun_gradients_of_a_loss_that_runs_the_model_are_the_steps(tmp_path, make):
    parts = getattr(M, make)()
    model, loss_fn = parts["model"], parts["loss_fn"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=tmp_path,
                            factory=f"loss_calls_model_models:{make}"):
            for step in range(5):
                features, labels = M.batch(step)
                if step == 3:  # the step's gradient, on a copy the recorder does not watch
                    twin = getattr(M, make)()
                    twin["model"].load_state_dict(model.state_dict())
                    truth = torch.autograd.grad(twin["loss_fn"](features, labels),
                                                list(twin["model"].parameters()))
                opt.zero_grad()
                loss_fn(features, labels, trap=step == 3).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], rep["cause"]) == (
        3, "backward", "<loss>", "invalid"), rep
    assert o["op"] == "SqrtBackward0" and o["samples"] == list(range(16)), o
    step = read_step(info.value.bundle_path, None)
    build(step, None, None, None)
    step.model.zero_grad(set_to_none=True)
    Runner(step).run(instrument=False)
    for p, t in zip(step.model.parameters(), truth):  # (row 0: the trap's NaN)
        torch.testing.assert_close(p.grad[1:], t[1:], rtol=1e-5, atol=1e-6)
