"""Samples named wrong, found by fuzz runs.

A batch-first model running a time-major ``nn.LSTM`` between two transposes on as many
samples as time steps: a backward origin after the LSTM, ``(B, T, H)`` with ``B == T``, was
read as ``(T, B, H)`` and named every sample; the LSTM's ``batch_first`` now settles where
its input's and output's samples are, followed through the transposes.

A model computing its own cross-entropy over a micro-batch whose every label is -100 (0/0):
the replay named no sample without gradient accumulation and the micro-batch's rows (not
told as all of them) with it; both now name all the rows, ``all N rows``.
"""

from __future__ import annotations

import pytest
import rows_found_models as M
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay
from replay.report import to_text

B = T = 4
BAD_STEP = 2


@pytest.mark.parametrize("bad_rows", [[2], [0, 3]])
def test_a_backward_origin_after_a_time_major_lstm_names_its_samples(tmp_path, bad_rows):
    torch.manual_seed(0)
    model, crit = M.make_tagger(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                            factory=M.make_tagger):
            for step in range(4):
                x, y = torch.randn(B, T, 5, generator=g), torch.randint(0, 6, (B,), generator=g)
                weight = torch.ones(B)
                if step == BAD_STEP:
                    weight[bad_rows] = 0.0
                opt.zero_grad()
                crit(model(x, weight), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (BAD_STEP, "backward")
    rep = replay(info.value.bundle_path, factory=M.make_tagger)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["phase"], o["op"], o["samples"]) == ("backward", "ReweightGradBackward", bad_rows)
    assert not o["all_samples"]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_label_ignored_names_all_rows_with_or_without_accumulation(tmp_path, accumulate):
    torch.manual_seed(0)
    model = M.make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path / "b", factory=M.make_lm):
            for step in range(4):
                for k in range(accumulate):
                    ids = torch.randint(0, 20, (B, 6), generator=g)
                    labels = ids.clone()
                    if step == BAD_STEP and k == accumulate - 1:
                        labels[:] = -100  # every token of the micro-batch ignored
                    (model(ids, labels=labels)["loss"] / accumulate).backward()
                opt.step()
                opt.zero_grad()
    rep = replay(info.value.bundle_path, factory=M.make_lm)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (o["op"], o["micro_batch"]) == ("aten.nll_loss_forward", accumulate - 1)
    assert (o["samples"], o["all_samples"]) == (list(range(B)), True)
    assert f"  samples    all {B} rows" in to_text(rep).splitlines()
