"""Optimizer state an update made infinite while the weights stayed finite
(``recorder.state_check``, ``replay.state_overflow``).

Adam squares each gradient into ``exp_avg_sq``: a gradient of 1e24 is finite, its square is
not, and the state holds +inf from then on. Every later update of those entries is
``m / sqrt(inf) = 0``: the run stops training without a NaN anywhere. The step's gradient norm
overflowed too, which alone is no event (huge but finite gradients are); at such a step the
update's state is checked after it.
"""

from __future__ import annotations

import json

import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


class ScaledNet(nn.Module):
    """A regressor whose output a constant multiplies (a LoRA ``alpha / r``, a target's unit)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.fc1, self.fc2, self.scale = nn.Linear(8, 16), nn.Linear(16, 1), scale

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def make_model(scale: float = 1.0) -> ScaledNet:
    torch.manual_seed(0)
    return ScaledNet(scale)


def _train(tmp_path, scale: float, steps: int = 6) -> list[float]:
    model = make_model(scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    with FlightRecorder(model, opt, loss_fn=nn.L1Loss(), out_dir=tmp_path,
                        factory="test_state_overflow:make_model",
                        factory_kwargs={"scale": scale}) as rec:
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            loss = rec.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_adams_second_moment_overflowed_by_a_gradient_of_1e24_is_an_optimizer_event(tmp_path):
    """Before, nothing was an event: the loss stayed finite and the weights stopped moving.
    Now the update of step 0 is the event, naming exp_avg_sq; the bundle's weights are finite,
    and the replay says the gradient's square overflowed float32 and to clip."""
    with pytest.raises(NonFiniteError) as info:
        _train(tmp_path, scale=1e25)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "optimizer", "+inf"), ev
    assert ev["state"]["fc1.weight"] == ["exp_avg_sq"], ev["state"]
    _, tensors = read_bundle(info.value.bundle_path)
    assert all(bool(torch.isfinite(t).all()) for k, t in tensors.items()
               if k.startswith("weights/"))
    res = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(res.stdout)
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["param"]) == \
        ("overflow", "optimizer", "fc1.weight"), rep["origin"]
    assert rep["not_rerun"] == "the bundle holds the state after the update"
    assert "exp_avg_sq of fc1.weight" in rep["hint"] and "beyond float32's largest" in \
        rep["hint"] and "clip_grad_norm_" in rep["hint"], rep["hint"]


def test_a_gradient_norm_that_overflowed_with_finite_state_is_no_event(tmp_path):
    """Gradients of ~1e19: their float32 sum of squares overflows (the step is checked), Adam's
    (1 - beta2) g ** 2 does not; training goes on, as without the recorder."""
    losses = _train(tmp_path, scale=1e19)
    assert all(map(lambda v: v == v and abs(v) < float("inf"), losses))
    assert not list(tmp_path.glob("*.nan"))
