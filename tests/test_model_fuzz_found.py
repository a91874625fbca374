"""Found by a fuzz run over how models are structured (record, bundle, replay): a model that
runs a time-major ``nn.LSTM`` between two transposes, trained on batches of as many samples
as time steps. A NaN the layer after the LSTM made in one sample was said to be in every
sample: its ``(B, T, H)`` output was read as ``(T, B, H)``, as a seq-first model's value whose
dim 1 has the batch's size."""

from __future__ import annotations

import model_fuzz_found_models as M
import pytest
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

B = T = 4
BAD_STEP = 2


def batches(bad_rows):
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        x, w = torch.randn(B, T, 5, generator=g), torch.ones(B)
        if step == BAD_STEP:
            w[bad_rows] = 0.0  # records the loader weighted 0
        yield x, w, torch.randint(0, 6, (B,), generator=g)


@pytest.mark.parametrize("bad_rows", [[3], [0, 2]])
def test_a_nan_after_a_time_major_lstm_names_its_samples(tmp_path, bad_rows):
    torch.manual_seed(0)
    model, crit = M.make_model(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                            factory=M.make_model):
            for x, w, y in batches(bad_rows):
                opt.zero_grad()
                crit(model(x, w), y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == \
        (BAD_STEP, "forward", "feats", bad_rows)
    rep = replay(info.value.bundle_path, factory=M.make_model)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["module"], o["op"], o["samples"]) == ("feats", "aten.log", bad_rows)


def test_a_backward_origin_in_a_shared_module_names_its_call(tmp_path):
    """A module called twice per forward whose second call's backward makes the NaN (log's
    derivative at the zeros a ReLU left, the where trap): the origin names call 1, as a
    forward origin names its call; before, a backward origin's call was null."""
    torch.manual_seed(0)
    model, crit = M.make_shared(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), torch.arange(6) % 3
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                            factory=M.make_shared):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = replay(info.value.bundle_path, factory=M.make_shared)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["phase"], o["module"], o["call"], o["op"]) == ("backward", "feat", 1, "LogBackward0")
