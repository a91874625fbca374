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


@pytest.mark.parametrize("end_step_before_update", [False, True])
def test_the_step_closes_before_the_hand_update_and_replays_the_overflow(
        tmp_path, end_step_before_update):
    """Without an optimizer the step stayed open until the next forward, through the
    hand-written update, which wrote this step's NaN gradients into the weights: the bundle
    held weights the step never ran with, and the replay could not re-run it unless the loop
    called ``rec.end_step()`` between backward and the update. The step now closes when the
    backward that wrote its gradients ends, so the bundle holds the weights the step ran with
    and the replay names the op, with ``end_step()`` or without."""
    err = _train(tmp_path, end_step_before_update=end_step_before_update)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "", [ROW])
    assert "written_after_forward" not in ev, ev
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
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


def test_a_hand_sgd_update_after_a_finite_backward_leaves_the_weights_the_step_ran_with(tmp_path):
    """The word-language-model example's loop at a learning rate far too high: the loss
    overflows at step 2 while its gradients stay finite. The step stayed open through the
    update, which moved every weight; the bundle held the moved weights, and the replay said
    "NOT reproduced" and blamed the factory for building a different model. The step now
    closes when its backward ends: the event comes out of ``loss.backward()``, before the
    update, the bundle holds the weights the step ran with, and the replay names the loss."""
    import hand_update_models as H

    model = H.make_lm()
    crit = torch.nn.NLLLoss()
    data = torch.randint(0, H.NTOKEN, (200, 4), generator=torch.Generator().manual_seed(0))
    hidden, updated = model.init_hidden(4), []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, loss_fn=crit, out_dir=tmp_path,
                            factory="hand_update_models:make_lm"):
            for step, i in enumerate(range(0, 180, 20)):
                model.zero_grad()
                hidden = H.repackage_hidden(hidden)
                output, hidden = model(data[i:i + 20], hidden)
                loss = crit(output, data[i + 1:i + 21].reshape(-1))
                loss.backward()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-1e37)
                updated.append(step)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss") and updated == [0, 1]
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], rep["cause"]) == \
        (True, "<loss>", "aten.nll_loss_forward", "overflow"), json.dumps(rep, indent=1)


def test_a_validation_forward_between_hand_updates_is_no_step(tmp_path):
    """The word-language-model example evaluates under ``torch.no_grad()`` between its
    hand-updated training steps. Without an optimizer each such forward was a step of its own
    (the step count ran ahead of the updates), and a NaN in a validation batch was found only
    when the next step or the exit closed it, as an input event of a training step. Once a
    step has closed at the end of its backward, a forward with gradients off is an evaluation
    between steps: checked when it returns, said as such, the step count the updates'."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    xv, yv = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
    xv[ROW, 1] = float("nan")  # (a validation record with a missing value)
    seen = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, loss_fn=crit, out_dir=tmp_path) as rec:
            for step in range(6):
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
                model.zero_grad()
                crit(model(x), y).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.1)
                seen.append(rec.step)
                with torch.no_grad():  # validation every other step; the NaN record at step 3
                    if step % 2 == 1:
                        crit(model(xv if step == 3 else xv[:ROW]), yv if step == 3 else yv[:ROW])
    ev = info.value.event
    assert seen == [1, 2, 3, 4]  # (the validation forwards took no step number)
    assert (ev["step"], ev["phase"], ev["samples"], ev.get("evaluation")) == (4, "input", [ROW],
                                                                                True), ev
    assert "in an evaluation forward (gradients off) before step 4" in str(info.value)


def test_an_evolution_strategys_forwards_under_no_grad_stay_its_steps(tmp_path):
    """An evolution strategy evaluates under ``torch.no_grad()`` and closes each generation
    with ``rec.end_step()``: its forwards are its steps (numbered on, a NaN record a step's
    input event), not evaluations between steps of a loop that trains by gradient."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    g = torch.Generator().manual_seed(0)
    seen = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=tmp_path) as rec:
            for gen in range(6):
                x = torch.randn(16, 4, generator=g)
                if gen == 4:
                    x[ROW, 0] = float("nan")
                with torch.no_grad():
                    model(x).mean()
                    for p in model.parameters():
                        p.add_(0.01 * torch.randn(p.shape, generator=g))
                rec.end_step()
                seen.append(rec.step)
    ev = info.value.event
    assert seen == [1, 2, 3, 4]
    assert (ev["step"], ev["phase"], ev["samples"], ev.get("evaluation")) == (
        4, "input", [ROW], None), ev
