"""End to end: a variance head written as a power of a number base (``2 ** s``), which the
loss takes the log of, given a record whose exponent is so far out that the power is 0 even in
float64. The replay's graph rule for a value made before the loss ran read such a power's
sign from its one input, the exponent (of no sign from a linear layer; negative for
``2 ** -exp(s)``): the 0 was called ``invalid``, a pole exact arithmetic makes too, with a
ReLU's exact zeros as the advice. A power of a base > 0 is positive for every exponent."""

from __future__ import annotations

import number_base_models as M
import pytest
import torch

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")
PLANT_STEP, BAD_ROW, BATCH = 2, 3, 8


def train(out_dir, factory: str, exponent: float) -> None:
    """Train until the recorder raises; at the plant step, row ``BAD_ROW`` of the batch drives the
    variance head's exponent ``s`` to ``exponent`` through a record in a wrong unit."""
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=out_dir,
                        factory=f"number_base_models:{factory}") as r:
        for step in range(4):
            x, y = torch.randn(BATCH, M.FEATURES, generator=g), torch.randn(BATCH, generator=g)
            if step == PLANT_STEP:
                w = model.body.weight.detach()[1]  # (the head's row: s = w @ x + b)
                x[BAD_ROW] = exponent * w / (w @ w)
            opt.zero_grad()
            loss = r.loss_fn(model(x), y)
            loss.backward()
            opt.step()


@pytest.mark.parametrize("factory, exponent", [
    ("make_log2", -4000.0),  # 2 ** -4000: 0 in float64 too
    ("make_half", 4000.0),  # 0.5 ** 4000
    ("make_decay", 8.3),  # 2 ** -exp(8.3) = 2 ** -4000
])
def test_a_number_base_power_that_underflowed_is_an_underflow(tmp_path, factory, exponent):
    with pytest.raises(NonFiniteError) as e:
        train(tmp_path, factory, exponent)
    assert (e.value.event["step"], e.value.event["phase"]) == (PLANT_STEP, "loss")
    rep = replay(e.value.bundle_path)
    o = rep["origin"]
    # (was "invalid": 'which exact arithmetic makes too', 'a ReLU's exact zeros')
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "aten.log", "-inf", [BAD_ROW]), rep
    assert "power of a base > 0" in rep["hint"] and "ReLU" not in rep["hint"], rep["hint"]
