"""An op that makes non-finite values of finite ones while the tensor it was given already
holds the -inf of a padding mask. The op finder asked only whether every input was finite, so
it passed such an op by and blamed the op that later made NaN of both: a division by a
temperature annealed to 0 was reported as the softmax of a fully masked row (no row was), and
an ``exp`` that overflowed on one sample's scores as the division of the hand-written softmax
after it, with every sample named."""

from __future__ import annotations

from pathlib import Path

import mask_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K, ROW = 3, 5


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, factory: str, at_step) -> NonFiniteError:
    model = getattr(M, factory.split(":")[1])()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory):
            for step in range(K + 2):
                x, mask, y = M.batch(step)
                at_step(step, model, x)
                opt.zero_grad()
                crit(model(x, mask), y).backward()
                opt.step()
    return info.value


def test_a_temperature_annealed_to_0_is_the_division_not_a_fully_masked_row(tmp_path):
    def anneal(step, model, x):  # linear to 0 at step K
        model.pool.temperature = max(0.0, 1.0 - step / K)

    err = train(tmp_path, "mask_models:make_pooled", anneal)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "forward", "pool")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["module"], o["made"], rep["cause"]) == \
        ("aten.div", "pool", "+inf", "invalid"), rep
    assert o["samples"] == list(range(M.BATCH))  # every row has a positive score
    assert [(c["op"], c["made"]) for c in o["chain"]] == \
        [("aten.div", "+inf"), ("aten._softmax", "nan")], o["chain"]
    assert "by the number 0" in rep["hint"] and "fully masked" not in rep["hint"], rep["hint"]
    note = next(p for p in rep["problems"] if "attributes" in p)  # the annealed value, re-run
    assert "pool.temperature = 0.0 (the factory built 1.0)" in note, note


def test_an_exp_overflowing_on_one_sample_beside_the_mask_names_that_sample(tmp_path):
    def unit_bug(step, model, x):  # one record in the wrong unit (x 1e4)
        if step == K:
            x[ROW] *= 1e4

    err = train(tmp_path, "mask_models:make_pooled_manual", unit_bug)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (K, "forward", "pool")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["module"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.exp", "pool", "+inf", [ROW], "overflow"), rep
    assert [(c["op"], c["made"]) for c in o["chain"]] == \
        [("aten.exp", "+inf"), ("aten.div", "nan")], o["chain"]
