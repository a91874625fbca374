"""Samples named wrong, found by fuzz runs.

A model computing its own cross-entropy over a micro-batch whose every label is -100 (0/0):
the replay named no sample without gradient accumulation and the micro-batch's rows (not
told as all of them) with it; both now name all the rows, ``all N rows``.
"""

from __future__ import annotations

import pytest
import rows_found_models as M
import torch

from recorder import FlightRecorder, NonFiniteError
from replay import replay
from replay.report import to_text

B = T = 4
BAD_STEP = 2


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
