"""A model output that is an object of the user's own class (``class Prediction`` with
``self.mean``, ``self.scale``): its tensor attributes are checked as the root's outputs are.

Before, the recorder read no tensor in it: a NaN the forward put there was first seen in the
loss, and the report said 'the loss is non-finite from finite model outputs: check the loss
inputs (targets out of range, ...)', which sends the user to the wrong code."""

from __future__ import annotations

import inspect
import json

import object_output_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

BAD = 2


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    if step == BAD:
        x[:, 0] = 0.0  # every record's first feature blank: the batch's total is 0
    return x, y


def train(losses: list, rec_dir=None) -> None:
    """Train to step BAD, the losses before it into ``losses``; with ``rec_dir`` under the
    recorder (which raises at BAD)."""
    model = M.make_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(loss_fn):
        for step in range(BAD):
            x, y = batch(step)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        x, y = batch(BAD)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    if rec_dir is None:
        return run(M.gaussian_nll)
    with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=rec_dir,
                        factory="object_output_models:make_head") as rec:
        run(rec.loss_fn)


def test_a_nan_inside_an_object_the_model_returns_is_a_forward_event_named_in_the_forward(
        tmp_path):
    clean, recorded = [], []
    train(clean)
    with pytest.raises(NonFiniteError) as info:
        train(recorded, tmp_path)
    ev = info.value.event
    # every row: the divisor is one total over the batch
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (BAD, "forward", "", "nan", list(range(8))), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], rep["cause"]) == \
        (True, "forward", "", "aten.div", "+inf", "invalid"), json.dumps(rep, indent=1)
    line = next(i for i, t in enumerate(inspect.getsource(M).splitlines(), 1) if "/ weight" in t)
    assert o["source"].endswith(f"object_output_models.py:{line}"), o["source"]
    assert [c["op"] for c in o["chain"]] == ["aten.div", "aten.mul"], o["chain"]
    assert "clamp_min(1)" in rep["hint"], rep["hint"]
    assert "finite model outputs" not in rep["hint"], rep["hint"]
    # and the recorder changed nothing the steps before it computed
    assert recorded == clean and len(clean) == BAD
