"""A loop that updates the weights itself (no optimizer given to the recorder): a bfloat16 model
whose float32 master copy an optimizer steps, written back into the model by hand."""

from __future__ import annotations

import json

import precision_models as P
import pytest
import replay_models as R
import torch
import torch.nn.functional as F
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

K, ROW = 4, 5


pytestmark = pytest.mark.usefixtures("in_tests_dir")


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


def _sam_first_step(opt, rho: float = 0.05) -> list[torch.Tensor]:
    """SAM's ascent (as the reference implementation writes it): w += rho * g / |g|."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        moves = [p.grad * (rho / (norm + 1e-12)) for p in params]
        for p, e in zip(params, moves):
            p.add_(e)
    opt.zero_grad()
    return moves


def test_sam_moving_the_weights_between_its_forwards_is_no_other_optimizer(tmp_path, caplog):
    """SAM perturbs the weights in place between a step's two forwards, then restores them and
    steps its base optimizer (the one recorded). The move was taken for another optimizer's
    update: a warning said the recorded optimizer never stepped, every forward closed a step,
    and a NaN made by the first forward (sample 5 below ShiftedLog's domain) reached the
    weights through the ascent and was reported as weights "already non-finite when the step
    began". Once the recorded optimizer steps after such a move, moves are the loop's own; the
    weights' first calls in the step show them finite, so the event is the forward's."""
    model = R.make_log_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    seen: list[int] = []
    with caplog.at_level("WARNING", logger="nanreplay"), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_log_net") as rec:
            for step in range(8):
                x, y = R.batch(step)
                if step == K:
                    x[ROW] *= 100.0
                crit(model(x), y).backward()
                moves = _sam_first_step(opt)
                crit(model(x), y).backward()  # at w + e
                with torch.no_grad():
                    for p, e in zip(model.parameters(), moves):
                        p.sub_(e)
                opt.step()
                opt.zero_grad()
                seen.append(rec.step)
    assert [r for r in caplog.records if r.name == "nanreplay"] == []
    # (the first iteration's move closed a step, as another optimizer's would, before the
    # recorded one stepped; from then on one step per iteration, its forwards micro-batches)
    assert [b - a for a, b in zip(seen, seen[1:])] == [1] * (len(seen) - 1), seen
    ev = info.value.event
    assert ev["step"] == seen[-1] and ev["micro_batch"] == 0  # the next step: K's
    assert (ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        ("forward", "act", 0, [ROW]), ev
    assert set(ev["written_after_forward"]) == {"lin.weight", "lin.bias", "head.weight",
                                                "head.bias"}, ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert rep["cause"] is None and rep["not_rerun"] == "weights written after its forward"
    assert any("between the step's forwards" in p for p in rep["problems"]), rep["problems"]
