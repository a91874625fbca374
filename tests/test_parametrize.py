"""The user's own parametrizations (``register_parametrization``): a symmetric weight, unit-norm
rows, a positive bias as ``exp`` of its raw parameter, with and without ``parametrize.cached()``.
Healthy runs train the same with the recorder; a row of zeros under the unit-norm
parametrization (0/0 at step 0) and a raw parameter a large learning rate grew past exp's range
(overflow at step K) are named in the parametrization's forward, by the user's name."""

from __future__ import annotations

import math
from contextlib import nullcontext

import parametrize_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch.nn.utils import parametrize

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
ROW = 2  # the row of lin's raw weight the plant zeroes


def _train(make: str, out_dir=None, steps: int = 4, lr: float = 0.1, cached: bool = False,
           zero_row: int | None = None, watch=None):
    """SGD with cross entropy on ``parametrize_models.<make>()``: the losses, or the
    NonFiniteError. ``watch(model)`` is called before each step's forward."""
    model = getattr(M, make)()
    if zero_row is not None:
        with torch.no_grad():
            model.lin.parametrizations.weight.original[zero_row] = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    crit, losses = nn.CrossEntropyLoss(), []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"parametrize_models:{make}") if out_dir else nullcontext()
    try:
        with rec:
            for step in range(steps):
                x, y = M.batch(step)
                if watch:
                    watch(model)
                opt.zero_grad()
                with parametrize.cached() if cached else nullcontext():
                    loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e
    return losses


@pytest.mark.parametrize("cached", [False, True])
def test_healthy_parametrized_runs_train_the_same_under_the_recorder(tmp_path, cached):
    for make in ("make_unit_rows", "make_positive"):
        plain = _train(make, cached=cached)
        recorded = _train(make, tmp_path / make, cached=cached)
        assert isinstance(plain, list) and plain == recorded, (make, plain, recorded)
        assert not list((tmp_path / make).glob("*.nan"))


def test_a_zero_row_under_a_unit_norm_parametrization_names_that_row_of_the_weight(tmp_path):
    """Row ROW of lin's raw weight is 0: the parametrization's W / W.norm(...) is 0/0 there
    at step 0; the hint names the weight by the user's name (lin.weight) and that row."""
    err = _train("make_unit_rows", tmp_path, zero_row=ROW)
    assert isinstance(err, NonFiniteError), err
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        0, "forward", "lin.parametrizations.weight.0", "aten.div", "invalid"), o
    assert o["source"] == source_line("parametrize_models.py", "return W / W.norm("), o
    # (the weight is the same for every record: each sample meets the 0/0)
    assert o["samples"] == list(range(len(M.batch(0)[0]))), o
    hint = rep["hint"]
    assert "the parameter lin.weight (kept by torch as lin.parametrizations.weight.original)" \
        in hint, hint
    assert f"along dim 0 ({ROW})" in hint and "clamp_min(eps)" in hint, hint


def test_exp_of_a_raw_parameter_grown_past_its_range_overflows_in_the_parametrization(tmp_path):
    """A large learning rate grows gain's raw bias; the first step whose forward sees it past
    log(float32 max) overflows in Positive's exp: that step, with the parametrization named."""
    limit, seen = math.log(torch.finfo(torch.float32).max), []

    def watch(model):
        seen.append(float(model.gain.parametrizations.bias.original.detach().max()))

    _train("make_positive", steps=12, lr=30.0, watch=watch)
    k = next(i for i, v in enumerate(seen) if v > limit)
    err = _train("make_positive", tmp_path, steps=12, lr=30.0)
    assert isinstance(err, NonFiniteError), err
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        k, "forward", "gain.parametrizations.bias.0", "aten.exp", "overflow"), o
    assert o["source"] == source_line("parametrize_models.py", "return torch.exp(X)"), o
    assert o["samples"] == list(range(len(M.batch(k)[0]))), o
    assert "the parametrization that makes gain.bias (Positive" in rep["hint"], rep["hint"]
