"""A loop that updates the weights itself (no optimizer given to the recorder): a bfloat16 model
whose float32 master copy an optimizer steps, written back into the model by hand."""

from __future__ import annotations

import json
from pathlib import Path

import precision_models as P
import pytest
import torch
import torch.nn.functional as F
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K, ROW = 4, 5


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # precision_models.py is trusted here


def _train(out_dir, end_step_before_update: bool) -> NonFiniteError:
    """Master-weights training; at step K sample ROW is 10x out of scale, and the
    hand-written log-softmax's exp overflows in bfloat16."""
    model = P.make_bf16_classifier()
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, out_dir=out_dir,
                            factory="precision_models:make_bf16_classifier") as rec:
            for step in range(8):
                x = torch.randn(8, P.D_IN, generator=g)
                y = x[:, :P.N_CLASSES].argmax(1)
                if step == K:
                    x[ROW] *= 10.0
                loss = F.nll_loss(model(x.bfloat16()).float(), y)
                loss.backward()
                if end_step_before_update:
                    rec.end_step()
                for p32, p16 in zip(master, model.parameters()):
                    p32.grad, p16.grad = p16.grad.float(), None
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    for p32, p16 in zip(master, model.parameters()):
                        p16.copy_(p32)
    return info.value


def test_weights_the_loops_own_update_broke_after_the_forward_are_not_blamed(tmp_path):
    """The step stays open until the next forward, through the hand-written update, which
    writes this step's NaN gradients into the weights: the event was "weights already
    non-finite when step 4 began", and the replay blamed an update "from finite gradients".
    The weights' modules returned finite values in that step, so the event is the forward's
    overflow, and the replay says the bundle's weights are not those the step ran with."""
    err = _train(tmp_path, end_step_before_update=False)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "", [ROW])
    assert "fc1.weight" in ev["written_after_forward"], ev
    res = invoke_cli(err.bundle_path, "--json")
    rep = json.loads(res.stdout)
    assert res.exit_code == 1 and rep["reproduced"] is False, rep
    assert rep["cause"] is None and rep["not_rerun"] == "weights written after its forward"
    assert "rec.end_step() after backward" in rep["hint"], rep["hint"]
    assert any("loop's own update" in p for p in rep["problems"]), rep["problems"]


def test_ending_the_step_before_the_hand_update_replays_the_overflow(tmp_path):
    """With ``rec.end_step()`` between backward and the update, as the hint says, the bundle
    holds the weights the step ran with and the replay names the op."""
    err = _train(tmp_path, end_step_before_update=True)
    assert (err.event["step"], err.event["phase"]) == (K, "forward")
    assert "written_after_forward" not in err.event
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("", "aten.exp", [ROW], "overflow"), json.dumps(rep, indent=1)


def test_a_bfloat16_overflow_is_not_sent_to_float32_which_has_its_range(tmp_path):
    """exp of 1e43 overflows bfloat16 (max 3.39e38) and float32 (3.40e38) alike: the hint said
    "compute this op in float32" and ``--try auto`` tried float32, which overflowed again. The
    hint now says to rescale (subtract the row max) or use float64, and auto tries float64."""
    err = _train(tmp_path, end_step_before_update=True)
    rep = json.loads(invoke_cli(err.bundle_path, "--json", "--try", "auto").stdout)
    assert rep["cause"] == "overflow" and rep["origin"]["dtype"] == "bfloat16", rep["origin"]
    hint = rep["hint"]
    assert "compute this op in float32" not in hint, hint
    assert "subtract the row max before exp" in hint and "float64" in hint, hint
    tries = {t["try"]: t for t in rep["what_if"]}
    assert "dtype=float32" not in tries and tries["dtype=float64"]["finite"] is True, tries
