"""End to end: learning to rank and dense retrieval as allRank / DPR / CLIP-style code writes it
(``ranking_models``): a listwise scorer whose padded slots hold ``-inf`` (recorded with
``allow_inf=[""]``, the root output may hold it), ListMLE's Plackett-Luce tail
``logcumsumexp`` minus the scores and RankNet's ``log(sigmoid(s_i - s_j))``."""

from __future__ import annotations

import pytest
import ranking_models as R
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

Q = 8  # queries a batch


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_listwise(out_dir, loss_fn, steps: int, scaled_at=None) -> NonFiniteError:
    """allRank's loop; ``scaled_at=(step, query)``: that query's features arrive unnormalised
    (raw counts, 5000x the others)."""
    model = R.make_scorer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, allow_inf=[""],
                            factory="ranking_models:make_scorer") as rec:
            for step in range(steps):
                b = R.lists(g, Q)
                if scaled_at and scaled_at[0] == step:
                    b["x"][scaled_at[1]] *= 5000
                loss = rec.loss_fn(model(b["x"], b["mask"]), b["y"], b["mask"])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return info.value


def test_listmle_masked_minus_masked_says_to_mask_before_the_subtraction(tmp_path):
    """The tail logcumsumexp of a padded slot is -inf, its score -inf: ``(tail - s) * m`` is
    NaN before the mask. The hint said "find the op that made the first infinity (the chain)"
    with no chain to follow: both infinities were the scorer's intended mask."""
    err = train_listwise(tmp_path, R.listmle, 3)
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    g = torch.Generator().manual_seed(0)
    padded = sorted((~R.lists(g, Q)["mask"]).any(1).nonzero().flatten().tolist())
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.sub", "nan", padded), rep
    assert "(tail - s) * m" in rep["source_lines"][o["source"]]
    assert "masked entries" in rep["hint"] and "torch.where(mask, a - b, 0.0)" in rep["hint"]
    assert "find the op that made the first infinity" not in rep["hint"]


def test_ranknet_log_sigmoid_underflow_chain_holds_no_earlier_nan(tmp_path):
    """An unnormalised query's score differences reach -1e4: sigmoid rounds to 0 and log(0) is
    -inf. The score differences of padded pairs (-inf - -inf, never selected) had made NaN
    earlier in the loss; the chain showed "aten.log made -inf -> aten.sub made nan" as if the
    log's infinity had made it."""
    err = train_listwise(tmp_path, R.ranknet, 6, scaled_at=(3, 2))
    assert (err.event["step"], err.event["phase"]) == (3, "loss")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "underflow", "<loss>", "aten.log", "-inf", [2]), rep
    assert [c["op"] for c in o["chain"]] == ["aten.log"], o["chain"]
    assert "logsigmoid" in rep["hint"] and "out of scale" in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=2", True)]


def test_lambdarank_delta_ndcg_over_a_zero_ideal_dcg_shows_the_whole_statement(tmp_path):
    """A query whose every label is 0 has an ideal DCG of 0: the |delta NDCG| weights, computed
    without gradient over two lines, are 0 / 0. Python names the statement's first line, and
    the report showed only it (``delta = (...).abs() * \\``), without the division."""
    err = train_listwise(tmp_path, R.lambdarank, 6)
    step = err.event["step"]
    g = torch.Generator().manual_seed(0)
    for _ in range(step + 1):
        b = R.lists(g, Q)
    no_relevant = (b["y"].clamp_min(0).amax(1) == 0).nonzero().flatten().tolist()
    assert (step, err.event["phase"], no_relevant) == (2, "loss", [3])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", no_relevant), rep
    text = rep["source_lines"][o["source"]]
    assert text.startswith("delta = (gain[:, :, None]") and text.endswith(
        "/ idcg[:, None, None]"), text
