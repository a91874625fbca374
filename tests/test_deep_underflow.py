"""A value positive in exact arithmetic that underflows to 0 in float64 as well, then divided
or logged, end to end: a sigmoid router's top-k scores renormalised (``w / w.sum()``) over a
record that drives every score to e^-800 or below, and a likelihood of sixteen independent
sigmoid probabilities normalised over the classes. Exact arithmetic keeps both positive, so the
0/0 is ``underflow`` (not ``invalid`` "which exact arithmetic makes too"), and the hint gives the
log-space form and says a wider type does not fix it. The same router over ReLU scores of a
zero record divides exact zeros: ``invalid``. The healthy router trains bit-identically with
and without the recorder."""

from __future__ import annotations

import contextlib
import json

import deep_underflow_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.positive import positive_result

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, ROW, B = 3, 5, 8  # the planted step, the planted row, the batch size
# the planted records' features: weights of at least 0.5 over D_IN = 4 features put every
# gate logit at or below 2 * FAR, e^-800 and less; and every factor of the likelihood in
# [e^-100, e^-50], > 0 in float32, sixteen of them e^-800 or less
FAR, LESS_FAR = -400.0, -25.0


def batch(step: int, plant: float | None):
    g = torch.Generator().manual_seed(step)
    x, y = torch.rand(B, M.D_IN, generator=g), torch.rand(B, 2, generator=g)
    if plant is not None and step == K:
        x[ROW] = plant
    return x, y


def train(make: str, out_dir, plant: float | None, steps: int = 5, record: bool = True,
          target=None):
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"deep_underflow_models:{make}") if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(steps):
            x, y = batch(step, plant)
            out = model(x)
            loss = loss_fn(out, target(out) if target else y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def fire(make: str, out_dir, plant: float, target=None) -> dict:
    with pytest.raises(NonFiniteError) as info:
        train(make, out_dir, plant, target=target)
    assert info.value.event["step"] == K
    return nanreplay_json(info.value.bundle_path)


def check(rep: dict, module: str, cause: str) -> str:
    o = rep["origin"]
    got = (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])
    assert got == (K, "forward", module, "aten.div", [ROW], cause), json.dumps(rep, indent=1)
    assert rep["reproduced"] is True
    return rep["hint"]


def test_a_sigmoid_routers_top_k_renormalised_below_float64_is_underflow(tmp_path):
    """The planted record's gate logits are all <= -800: in float64 their sigmoids are 0
    too, yet positive in exact arithmetic: the router's 0/0 is an underflow, fixed in log
    space (a softmax of logsigmoid scores), which float64 does not fix."""
    gate = M.make_sigmoid_moe().moe.gate
    far = torch.full((1, M.D_IN), FAR, dtype=torch.float64)
    logits = gate.double()(far)
    assert bool((torch.sigmoid(logits) == 0).all()) and bool((logits > -1e4).all())
    hint = check(fire("make_sigmoid_moe", tmp_path, FAR), "moe", "underflow")
    for words in ("0/0", "sigmoid", "positive in exact arithmetic", "below float64's range",
                  "wider type does not fix", "softmax(log_w", "logsigmoid"):
        assert words in hint, (words, hint)
    assert "which exact arithmetic makes too" not in hint, hint


def test_a_product_of_many_probabilities_normalised_below_float64_is_underflow(tmp_path):
    """Sixteen probabilities of at most sigmoid(-50) each: their product is below e^-800, 0
    in float64 as well, but a product of factors > 0: an underflow, whose fix is the sum of
    the factors' logs normalised by a softmax."""
    lin = M.make_product_posterior().posterior.lin
    far = torch.full((1, M.D_IN), LESS_FAR, dtype=torch.float64)
    p = torch.sigmoid(lin.double()(far)).view(M.CLASSES, M.FEATURES)
    assert bool((p.float() > 0).all()) and bool((p.prod(-1) == 0).all())
    hint = check(fire("make_product_posterior", tmp_path, LESS_FAR,
                      target=lambda out: torch.full_like(out, 1 / M.CLASSES)),
                 "posterior", "underflow")
    for words in ("0/0", "a product of factors > 0", "below float64's range",
                  "wider type does not fix", "softmax(log_w", "sum of the factors' logs"):
        assert words in hint, (words, hint)


def test_a_relu_routers_exact_zeros_renormalised_stay_invalid(tmp_path):
    """A record of -1s (a missing-value code below the data's [0, 1)): every ReLU score of
    its row is exactly 0 (no rounding), so the same renormalisation's 0/0 is invalid, with
    the eps advice, no log-space rewrite."""
    hint = check(fire("make_relu_moe", tmp_path, -1.0), "moe", "invalid")
    assert "exact arithmetic makes too" in hint and "eps" in hint, hint
    assert "log_w" not in hint and "wider type" not in hint, hint


def test_a_healthy_sigmoid_router_trains_bit_identically_under_the_recorder(tmp_path):
    plain = train("make_sigmoid_moe", tmp_path, None, record=False)
    recorded = train("make_sigmoid_moe", tmp_path, None)
    assert plain == recorded and all(map(torch.isfinite, map(torch.tensor, plain)))
    assert not list(tmp_path.glob("*.nan"))


def test_a_power_is_positive_by_its_base_not_its_exponent():
    """``(-2) ** t`` of a positive ``t`` (an exp's output) is not positive in exact arithmetic,
    so a 0 made of it is no underflow: pow's sign is its base's (a number base too, which the
    op's tensor inputs leave out), never its exponent's."""
    t = torch.exp(torch.tensor([0.5, 1.0]))
    marked = {id(t)}

    def positive(x):
        return id(x) in marked
    assert not positive_result("pow", [t], [-2.0, t], positive)
    assert positive_result("pow", [t], [2.0, t], positive)
    assert positive_result("pow", [t], [t, -3], positive)
    assert not positive_result("pow", [-t], [-t, 3], positive)
