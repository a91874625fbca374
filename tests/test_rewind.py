"""Rewind and what-if (issue 15): ``FlightRecorder(..., rewind=N)`` keeps the last N to 2N steps
replayable, ``nanreplay`` re-runs them from the copy to the first step where anything went
non-finite, and ``--try KEY=VALUE`` re-runs them with one change.

Planted bugs whose cause lies steps before the event, each in a real training loop, each
replayed over the window to the right first step, with a try that makes it finite next to one
that does not: an LR-schedule spike, weights growing to overflow under too large a learning
rate, NaN written by Adam(eps=0) into embedding rows read later, Adam(eps=0) on an input that
joins the model late.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import models as M
import pytest
import rewind_models as R
import torch
from bundles import invoke_cli, one_error_line
from ci import requires_cuda
from test_recorder_sync import FLIGHT, _per_step
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def nanreplay(bundle: Path, *tries: str) -> dict:
    res = invoke_cli(bundle, "--json", *[a for t in tries for a in ("--try", t)])
    assert res.exit_code in (0, 1), res.stderr
    return json.loads(res.stdout)


def what_if(report: dict) -> dict[str, dict]:
    return {t["try"]: t for t in report["what_if"]}


# ---------------------------------------------------------------------------------------------
# the loops


def lr_spike(out_dir, rewind=8):
    """A schedule whose multiplier is 1e4 from step 6 on (a warm restart with a wrong base):
    the weights explode over the next steps and the head's matmul overflows at step 15."""
    torch.manual_seed(0)
    model = R.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e4 if s >= 6 else 1.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, lr_scheduler=sched,
                            factory="rewind_models:make_classifier", rewind=rewind):
            for s in range(40):
                x, y = R.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                sched.step()
    return info.value


def divergent_regression(out_dir):
    """SGD with lr 1.5 on a least-squares problem whose Hessian is 2I: the error doubles at
    every step from the first, until the MSE overflows at step 40."""
    torch.manual_seed(0)
    model = R.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1.5)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="rewind_models:make_regressor", rewind=16):
            for s in range(300):
                x, y = R.regression_batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def _rare_batch(step):
    import infinity_models as I

    idx, _ = I.token_batch(step)
    idx = idx % 8
    if step == 0:
        idx[0, :8] = torch.arange(8)
    if step == 5:
        idx[2, 0] = 12
    return idx, torch.arange(I.BATCH) % I.N_CLASSES


def _rare_losses(steps, eps):
    """The loss of each of the first ``steps`` steps of rare_tokens' loop trained with Adam(eps)."""
    import infinity_models as I

    torch.manual_seed(0)
    model = I.make_token_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    losses = []
    for s in range(steps):
        x, y = _rare_batch(s)
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rare_tokens(out_dir, rewind=2, guard_optimizer=False):
    """Tokens 8-15 are absent until step 5: Adam(eps=0) makes their rows 0/0 at step 0."""
    import infinity_models as I

    make = _rare_batch
    torch.manual_seed(0)
    model = I.make_token_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                            guard_optimizer=guard_optimizer,
                            factory="infinity_models:make_token_classifier"):
            for s in range(8):
                x, y = make(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def late_input(out_dir):
    """An auxiliary input joins at step 5 with a dead channel: Adam(eps=0)'s first update of
    ``aux.weight`` is 0/0 in that column, caught with step 6's read."""
    torch.manual_seed(0)
    model = R.make_fusion()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="rewind_models:make_fusion"):
            for s in range(20):
                args, kwargs, y = R.aux_batch(s)
                opt.zero_grad()
                crit(model(*args, **kwargs), y).backward()
                opt.step()
    return info.value


# ---------------------------------------------------------------------------------------------
# planted bugs, replayed over the window


def test_lr_schedule_spike_is_found_where_the_schedule_jumped(out_dir):
    err = lr_spike(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (15, "forward", "head")
    meta, _ = read_bundle(err.bundle_path)
    assert meta["rewind"]["copy_step"] == 0 and meta["rewind"]["steps"] == list(range(16))
    rep = nanreplay(err.bundle_path, "lr=1e-4x", "drop=0")
    assert rep["reproduced"] and rep["cause"] == "overflow"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("head", "aten.addmm")
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [0, 15] and w["event_step"] == 15
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["module"]) == (15, "forward", "head")
    # the overflowing matmul's kind is the CPU's BLAS kernel's: +inf on the Intel machines this
    # ran on before, NaN on an AMD EPYC, where a dot product's partial sums meet +inf and -inf;
    # the window's re-run must say what the recorded step saw
    assert first["kind"] == err.event["kind"] and first["kind"] in ("+inf", "nan")
    assert (w["precursors_began"]["step"], w["precursors_began"]["kind"]) == (6, "lr_jump")
    # the recorded learning rates, step by step: the scheduler's, not re-derived
    assert [s["lr"] for s in w["per_step"]] == [0.1] * 6 + [1000.0] * 10
    tries = what_if(rep)
    assert tries["lr=1e-4x"]["finite"] and tries["lr=1e-4x"]["event_step"] is None
    assert not tries["drop=0"]["finite"]
    assert tries["drop=0"]["origin"]["step"] == 15
    assert tries["drop=0"]["origin"]["module"] == "head"


def test_window_re_runs_each_step_with_the_attributes_the_loop_had_set_then(out_dir):
    """A temperature the loop anneals linearly to 0 (``model.head.temperature = 1 - s / 4``,
    no floor): step 4 divides the logits by 0. The window's steps re-run with the temperature
    each had (1.0, 0.75, 0.5, 0.25): re-run with the event step's 0, step 0 was already
    non-finite and the window said the run was not reproduced."""
    torch.manual_seed(0)
    model = R.make_annealed_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="rewind_models:make_annealed_classifier"):
            for s in range(8):
                model.head.temperature = 1.0 - s / 4
                x, y = R.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (4, "forward", "head")
    meta, _ = read_bundle(err.bundle_path)
    assert [r["attrs"] for r in meta["rewind"]["records"]] == [
        {}, *({"head": {"temperature": 1.0 - s / 4}} for s in range(1, 5))]
    rep = nanreplay(err.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["op"]) == (True, "invalid", "aten.div")
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [0, 4], w
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["module"]) == (4, "forward", "head"), first
    assert [s["step"] for s in w["per_step"]] == [0, 1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in w["per_step"][:4]), w["per_step"]


def test_weights_growing_to_overflow_were_growing_before_the_window(out_dir):
    err = divergent_regression(out_dir)
    assert (err.event["step"], err.event["phase"]) == (40, "loss")
    rep = nanreplay(err.bundle_path, "clip=1.0", "lr=2x")
    assert rep["cause"] == "overflow" and rep["origin"]["op"] == "aten.mse_loss"
    w = rep["window"]
    assert w["reproduced"] and w["copy_step"] == 16 and w["steps"] == [16, 40]
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["module"], first["kind"]) == \
        (40, "loss", "<loss>", "+inf")
    began = w["precursors_began"]
    assert began["step"] == 16 and began["kind"].endswith("_rise")
    tries = what_if(rep)
    assert tries["clip=1.0"]["finite"]
    # twice the learning rate: it still overflows, earlier
    assert not tries["lr=2x"]["finite"]
    assert tries["lr=2x"]["origin"]["phase"] == "loss"
    assert 16 <= tries["lr=2x"]["event_step"] < 40


def test_nan_written_into_embedding_rows_is_the_update_that_wrote_it(out_dir):
    err = rare_tokens(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["after_update"]) == \
        (0, "optimizer", True)
    rep = nanreplay(err.bundle_path, "eps=1e-8", "lr=0.1x")
    # without rewind this bundle holds the weights after the update and cannot re-run it
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    o = rep["origin"]
    assert (o["phase"], o["params"], o["op"], o["made"]) == \
        ("optimizer", ["emb.weight"], "aten.addcdiv_", "nan")
    assert not any("cannot be re-run" in p for p in rep["problems"])
    assert rep["hint"].endswith("with eps=0 an element whose gradients have all been exactly 0 "
                                "has m = v = 0, so m / (sqrt(v) + eps) is 0/0: set eps > 0 "
                                "(the default 1e-8); it made only row(s) 8, 9, 10, 11, 12, 13, "
                                "14, 15 of 16 of emb.weight non-finite, every one a row whose "
                                "gradient was all 0 (absent from the batch)")
    assert o["rows"] == list(range(8, 16))  # (tokens 8-15 join at step 5)
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [0, 1]
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["params"], first["op"]) == \
        (0, "update", ["emb.weight"], "aten.addcdiv_")
    tries = what_if(rep)
    assert tries["eps=1e-8"]["finite"]
    assert not tries["lr=0.1x"]["finite"]  # 0/0 whatever the learning rate
    assert (tries["lr=0.1x"]["origin"]["step"], tries["lr=0.1x"]["origin"]["phase"]) == \
        (0, "update")


def test_adam_eps0_on_an_input_that_joins_late_is_the_update_at_that_step(out_dir):
    err = late_input(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (5, "optimizer", ["aux.weight"])
    rep = nanreplay(err.bundle_path, "eps=1e-8", "lr=0.1x", "clip=1.0")
    w = rep["window"]
    assert w["reproduced"] and w["copy_step"] == 0 and w["steps"] == [0, 6]
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["params"], first["op"]) == \
        (5, "update", ["aux.weight"], "aten.addcdiv_")
    assert rep["origin"]["op"] == "aten.addcdiv_" and rep["cause"] == "optimizer"
    assert [s["step"] for s in w["per_step"]] == [0, 1, 2, 3, 4, 5]
    tries = what_if(rep)
    assert tries["eps=1e-8"]["finite"]
    for t in ("lr=0.1x", "clip=1.0"):
        assert not tries[t]["finite"] and tries[t]["event_step"] == 5, tries[t]


def drifting_fp16(out_dir):
    """float16 autocast with a GradScaler: the feature scale doubles every step, the scaled
    gradients overflow (the scaler skips every step) and at step 15 the first Linear's
    float16 output overflows."""
    torch.manual_seed(0)
    model = R.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                            factory="rewind_models:make_classifier", rewind=4):
            for s in range(40):
                x, y = R.drifting_batch(s)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    return info.value


def test_float16_overflow_under_a_grad_scaler_is_fixed_by_float32(out_dir):
    err = drifting_fp16(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (15, "forward", "body.0")
    meta, _ = read_bundle(err.bundle_path)
    rep = nanreplay(err.bundle_path, "auto", "drop=0")
    assert rep["cause"] == "overflow" and rep["origin"]["op"] == "aten._to_copy"
    w = rep["window"]
    assert w["reproduced"] and w["steps"] == [8, 15]
    first = w["first_non_finite"]
    assert (first["step"], first["phase"], first["module"]) == (15, "forward", "body.0")
    # the steps the GradScaler skipped in training are skipped in the re-run
    recorded = [r["skipped"] for r in meta["rewind"]["records"]]
    assert [s["skipped"] for s in w["per_step"][:-1]] == recorded[:-1] == [True] * 7
    assert w["precursors_began"]["kind"] == "loss_rise"
    tries = what_if(rep)
    assert list(tries) == ["dtype=float32", "lr=0.1x", "clip=1.0", "drop=0"]
    assert tries["dtype=float32"]["finite"]
    for t in ("lr=0.1x", "clip=1.0", "drop=0"):
        assert not tries[t]["finite"] and tries[t]["event_step"] == 15
        assert tries[t]["origin"]["module"] == "body.0"


def edited_weight(out_dir):
    """A weight edited in place between steps 2 and 3 (a NaN written by hand)."""
    import infinity_models as I

    torch.manual_seed(0)
    model = I.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2,
                            factory="infinity_models:make_mlp"):
            for s in range(6):
                if s == 3:
                    with torch.no_grad():
                        model[2].weight[1, 5] = float("nan")
                x, y = I.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def test_weights_written_outside_the_optimizer_do_not_come_back_from_the_window(out_dir):
    """Nothing the window re-runs writes the edited weight, so the re-run stays finite and the
    report keeps the cause ``weights`` (issue 11, item 2)."""
    err = edited_weight(out_dir)
    assert (err.event["step"], err.event["phase"]) == (3, "weights")
    rep = nanreplay(err.bundle_path)
    assert rep["cause"] == "weights" and rep["origin"]["params"] == ["2.weight"]
    w = rep["window"]
    assert w["steps"] == [0, 3] and not w["reproduced"] and w["first_non_finite"] is None
    assert "re-running the window from the copy at step 0 reached step 3 with every value " \
           "finite: the event does not come back from the window" in rep["problems"]


def test_a_try_on_weights_written_by_hand_is_inconclusive_and_auto_proposes_none(out_dir,
                                                                              tmp_path):
    """No re-run replays a weight written by hand: the unchanged window is finite, so a try's
    finite window proves nothing (it was reported as a fix), and ``auto`` proposes no learning
    rate or clipping for it (it proposed both), not even when the precursors began early."""
    from replay.load import read_step
    from replay.rebuild import build
    from replay.whatif import auto_tries

    err = edited_weight(out_dir)
    rep = nanreplay(err.bundle_path, "auto")
    assert (rep["cause"], rep["what_if"]) == ("weights", [])
    assert rep["problems"][-1] == (
        "--try auto: no what-if fits a weights cause: the weights were written outside "
        "optimizer.step(), which no re-run replays, so no change to the recorded steps can "
        "test a fix")
    step = read_step(err.bundle_path)
    build(step, None, None)
    rep["window"]["precursors_began"] = {"step": 0, "kind": "grad_norm_rise", "detail": ""}
    assert auto_tries(step, rep) == []
    tries = what_if(nanreplay(err.bundle_path, "lr=0.1x", "clip=1.0"))
    for t in tries.values():
        assert (t["finite"], t["inconclusive"], t["event_step"], t["steps"]) == \
            (True, True, None, [0, 3])
    page = tmp_path / "r.html"
    res = invoke_cli(err.bundle_path, "--try", "lr=0.1x", "--html", page)
    loss = f"(loss {tries['lr=0.1x']['loss']:.4g})"
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("  what-if")] == [
        f"  what-if    lr=0.1x        inconclusive: finite through step 3 {loss}; the unchanged "
        "re-run is finite too: this try proves nothing"]
    assert f"<code>lr=0.1x</code></td><td>inconclusive: finite through step 3 {loss}; the " \
           "unchanged re-run is finite too: this try proves nothing</td>" in page.read_text()


def test_auto_tries_the_remedies_of_the_cause(out_dir):
    rep = nanreplay(late_input(out_dir).bundle_path, "auto")
    tries = what_if(rep)
    assert list(tries) == ["lr=0.1x", "clip=1.0", "eps=1e-8"]
    assert [t["finite"] for t in tries.values()] == [False, False, True]
    assert [t["inconclusive"] for t in tries.values()] == [False, False, False]


def test_text_report_has_one_line_per_try_and_the_window(out_dir):
    err = rare_tokens(out_dir)
    res = invoke_cli(err.bundle_path, "--try", "eps=1e-8", "--try", "lr=0.1x")
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    # the example of docs/cli.md, line for line
    assert lines[:3] == [
        "nanreplay: step 0, optimizer event — reproduced",
        "  origin     optimizer: nan made by aten.addcdiv_ in parameter emb.weight",
        "  cause      optimizer — aten.addcdiv_ in Adam's update at step 0 made nan in "
        "emb.weight from finite gradients and weights (re-run from the rewind window); with "
        "eps=0 an element whose gradients have all been exactly 0 has m = v = 0, so m / "
        "(sqrt(v) + eps) is 0/0: set eps > 0 (the default 1e-8); it made only row(s) 8, 9, "
        "10, 11, 12, 13, 14, 15 of 16 of emb.weight non-finite, every one a row whose gradient "
        "was all 0 (absent from the batch)"]
    assert "  window     steps 0-1 re-run from the copy at step 0: the event came back at the " \
           "recorded step" in lines
    assert "  first      step 0: nan in the update of emb.weight (aten.addcdiv_)" in lines
    # a finite try says its loss at the last step re-run: the loss training with eps=1e-8 has
    trained = _rare_losses(2, eps=1e-8)[1]
    assert [ln for ln in lines if ln.startswith("  what-if")] == [
        f"  what-if    eps=1e-8       finite through step 1 (loss {trained:.4g})",
        "  what-if    lr=0.1x        nan at step 0 (update of emb.weight (aten.addcdiv_))"]
    tries = what_if(nanreplay(err.bundle_path, "eps=1e-8"))
    assert tries["eps=1e-8"]["loss"] == pytest.approx(trained, rel=1e-5)


def test_html_report_has_the_what_if_table(out_dir, tmp_path):
    err = rare_tokens(out_dir)
    page = tmp_path / "r.html"
    res = invoke_cli(err.bundle_path, "--try", "eps=1e-8", "--html", page)
    assert res.exit_code == 0, res.stderr
    html = page.read_text()
    assert "<h2>What if</h2>" in html and "<code>eps=1e-8</code></td><td>finite" in html
    assert "<h2>Rewind window</h2>" in html


def test_a_try_without_a_window_reruns_the_recorded_step(toy, monkeypatch):
    monkeypatch.chdir(HERE.parent / "examples")
    rep = nanreplay(toy, "drop=5", "lr=0.1x")
    assert rep["window"] is None
    tries = what_if(rep)
    assert tries["drop=5"]["finite"] and tries["drop=5"]["steps"] == [37, 37]
    assert tries["drop=5"]["inconclusive"] is False
    # the recorded step's update comes after its forward event: no rate can change it
    assert tries["lr=0.1x"]["finite"] is None and "rewind=N" in tries["lr=0.1x"]["note"]


def test_a_guard_bundles_tries_start_from_the_copies_before_the_update(out_dir):
    """``guard_optimizer=True`` without a window: the bundle holds the weights, gradients and
    optimizer state from before the update, and each try re-runs the update from them, not
    from the weights the main replay's own re-run of the update left non-finite."""
    err = rare_tokens(out_dir, rewind=None, guard_optimizer=True)
    assert (err.event["step"], err.event["phase"], err.event["after_update"]) == \
        (0, "optimizer", False)
    rep = nanreplay(err.bundle_path, "eps=1e-8", "lr=0.1x")
    assert rep["window"] is None and rep["reproduced"] and rep["cause"] == "optimizer"
    assert (rep["origin"]["params"], rep["origin"]["op"], rep["origin"]["made"]) == \
        (["emb.weight"], "aten.addcdiv_", "nan")
    # the eps=0 explanation, as the rewind window's re-run of the same update gives it, then
    # the rows this re-run of the update made non-finite (the window's names none)
    assert rep["hint"] == (
        "aten.addcdiv_ in Adam's update at step 0 made nan in emb.weight from finite gradients "
        "and weights (re-run from the copies taken before the update); with eps=0 an element "
        "whose gradients have all been exactly 0 has m = v = 0, so m / (sqrt(v) + eps) is 0/0: "
        "set eps > 0 (the default 1e-8); it made only row(s) 8, 9, 10, 11, 12, 13, 14, 15 of 16 "
        "of emb.weight non-finite, every one a row whose gradient was all 0 (absent from the "
        "batch)")
    assert rep["origin"]["rows"] == list(range(8, 16))
    tries = what_if(rep)
    t = tries["eps=1e-8"]
    assert (t["finite"], t["inconclusive"], t["event_step"], t["origin"], t["steps"]) == \
        (True, False, None, None, [0, 0])
    t = tries["lr=0.1x"]  # 0/0 whatever the learning rate
    assert (t["finite"], t["event_step"]) == (False, 0)
    assert (t["origin"]["phase"], t["origin"]["params"], t["origin"]["op"]) == \
        ("update", ["emb.weight"], "aten.addcdiv_")


def test_a_bundle_with_only_the_weights_after_the_update_re_runs_no_try(out_dir):
    """Without guard_optimizer or a window the bundle holds the weights the bad update left and
    no batch: there is nothing to re-run a change of that update from, so no try is a fix."""
    err = rare_tokens(out_dir, rewind=None)
    assert (err.event["step"], err.event["phase"], err.event["after_update"]) == \
        (0, "optimizer", True)
    res = invoke_cli(err.bundle_path, "--try", "eps=1e-8", "--try", "lr=0.1x")
    assert res.exit_code == 1, res.stderr
    note = ("the bundle holds the weights after the update, not those before it: record with "
            "FlightRecorder(..., guard_optimizer=True) or rewind=N to re-run it with a change")
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("  what-if")] == [
        f"  what-if    eps=1e-8       not re-run: {note}",
        f"  what-if    lr=0.1x        not re-run: {note}"]
    tries = what_if(nanreplay(err.bundle_path, "eps=1e-8"))
    assert tries["eps=1e-8"] == {"try": "eps=1e-8", "finite": None, "inconclusive": None,
                                 "event_step": None, "origin": None, "note": note}


def test_the_replay_never_writes_the_bundles_tensors(out_dir):
    """The rebuilt model shares the bundle's weights (no second copy): the main replay's re-run
    of a guard bundle's update and its forwards (BatchNorm's running statistics) must leave
    them as recorded, since every what-if starts from them."""
    from replay.analyze import analyze
    from replay.load import read_step
    from replay.rebuild import build

    torch.manual_seed(0)
    model = R.make_normed_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="rewind_models:make_normed_classifier"):
            for s in range(4):
                x, y = R.dead_feature_batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    # (and maybe the bias before the norm: it subtracts the batch mean, so that gradient is 0
    # in exact arithmetic; in float32 some of its elements are 0 or a rounding residue, as the
    # CPU's kernels sum them: exactly 0 on AMD EPYC, a residue on Intel Xeon)
    assert (err.event["step"], err.event["phase"], err.event["params"][0]) == \
        (0, "optimizer", "0.weight")
    assert set(err.event["params"]) <= {"0.weight", "0.bias"}, err.event["params"]
    step = read_step(err.bundle_path)
    build(step, None, None)
    rep = analyze(step, ["eps=1e-8"])
    assert (rep["cause"], rep["origin"]["op"]) == ("optimizer", "aten.addcdiv_")
    assert what_if(rep)["eps=1e-8"]["finite"] is True
    _, recorded = read_bundle(err.bundle_path)
    assert sorted(step.tensors) == sorted(recorded)
    changed = [k for k in recorded if not M.identical(step.tensors[k], recorded[k])]
    assert changed == []


# ---------------------------------------------------------------------------------------------
# the recorder side


def test_rewind_changes_nothing_training_computes(out_dir):
    def train(rewind):
        torch.manual_seed(0)
        model = R.make_classifier()  # dropout: the recorder must draw no random number
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        crit = nn.CrossEntropyLoss()
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind):
            for s in range(12):
                x, y = R.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], torch.get_rng_state()

    (a, rng_a), (b, rng_b) = train(None), train(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(rng_a, rng_b)


def test_one_host_read_per_step_with_rewind(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2) as rec:
        per_step = _per_step(model, opt, crit, 7)
    assert [len(c) for c in per_step] == [1] * 7, per_step
    assert all(f == FLIGHT for c in per_step for _, f in c)
    assert rec.event is None


@pytest.mark.parametrize("name", ["grad_scaler", "ddp", "closure", "record_loss", "tensor_lr"])
def test_one_host_read_per_step_on_every_step_path_with_rewind(out_dir, name, monkeypatch):
    """The step paths of test_recorder_sync (GradScaler skips, DDP, step(closure),
    record_loss, a tensor learning rate changed by a scheduler), recorded with rewind=2."""
    import test_recorder_sync as S

    init, made = FlightRecorder.__init__, []

    def with_rewind(self, *args, **kwargs):
        init(self, *args, rewind=2, **kwargs)
        made.append(self)

    monkeypatch.setattr(FlightRecorder, "__init__", with_rewind)
    per_step = S._recorder_syncs_per_step(S.SCENARIOS[name], torch.device("cpu"), out_dir)
    assert len(made) == 1 and made[0].rewind == 2
    assert all(read == ("tolist", FLIGHT) for window in per_step for read in window), per_step
    if name != "grad_scaler":  # (its skipped steps' reads fall in the next step's window)
        assert per_step == [[("tolist", FLIGHT)]] * S.STEPS + [[("tolist", FLIGHT)]], per_step


def test_memory_is_bounded_and_reported(out_dir, caplog):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    with caplog.at_level(logging.INFO, logger="nanreplay"):
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=3).attach()
    assert f"rewind=3 keeps two copies of the training state ({state} bytes each now, in " \
        "host memory; 0 bytes on the device)" in caplog.text
    sizes = []
    for s in range(20):
        x, y = M.batch(s)
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sizes.append(rec.memory_bytes["rewind_host"])
    rec.detach()
    batch = sum(t.numel() * t.element_size() for t in M.batch(0)) + 4 * 16 * 4  # + outgrad
    # two copies, and at most 2N steps of batches; the same from the first full window on
    assert max(sizes) <= 2 * state + 6 * batch
    assert len(set(sizes[8:])) <= 3 and sizes[-1] >= 2 * state
    assert rec.memory_bytes["rewind_device"] == 0


@pytest.mark.parametrize("value", [0, -2, 1.5, "8", True])
def test_bad_rewind_values_are_one_line_errors(out_dir, value):
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), rewind=value, out_dir=out_dir)
    msg = str(info.value)
    assert msg.startswith("FlightRecorder: rewind must be an int >= 1") and "\n" not in msg
    assert repr(value) in msg


@pytest.mark.parametrize("value, says", [
    ("foo=1", "expected KEY=VALUE with KEY one of lr, eps, clip, dtype, drop, wd"),
    ("lr", "lr needs a value: --try lr=1e-4 (or lr=0.1x)"),
    ("lr=", "lr needs a value: --try lr=1e-4 (or lr=0.1x)"),
    ("drop=", "drop needs a value: --try drop=3,7"),
    ("wd=", "wd needs a value: --try wd=0.01"),
    ("lr=fast", "'fast' is not a learning rate such as 1e-4"),
    ("lr=-1x", "is not a factor such as 0.1x"),
    ("clip=0", "is not a maximum gradient norm such as 1.0 (a finite number > 0)"),
    ("eps=nan", "is not an epsilon such as 1e-8"),
    ("dtype=int8", "dtype must be one of float32, float64, bfloat16"),
    ("drop=a,b", "drop takes sample indices separated by commas"),
])
def test_bad_try_values_are_one_line_errors(toy, value, says):
    line = one_error_line(invoke_cli(toy, "--try", value))
    assert line.startswith(f"nanreplay: --try {value!r}: ") and says in line, line


def test_a_try_the_optimizer_cannot_take_is_a_one_line_error(out_dir):
    err = lr_spike(out_dir, rewind=4)
    line = one_error_line(invoke_cli(err.bundle_path, "--try", "eps=1e-8"))
    assert line == "nanreplay: --try eps=1e-8: SGD has no 'eps' setting; try another key " \
                   "(lr, wd, clip)"
    line = one_error_line(invoke_cli(err.bundle_path, "--try", "drop=16"))
    assert line == "nanreplay: --try drop=16: the batch has 16 samples (0-15); pass indices " \
                   "within it"


def test_a_trainer_callback_refuses_a_bad_rewind_when_built():
    pytest.importorskip("lightning")
    from recorder.lightning import FlightRecorderCallback

    with pytest.raises(ValueError, match="^FlightRecorder: rewind must be an int >= 1"):
        FlightRecorderCallback(module="model", rewind=-1)
    assert FlightRecorderCallback(module="model", rewind=4) is not None


@requires_cuda
def test_no_sync_in_the_recorders_hooks_on_cuda_with_rewind(out_dir, monkeypatch):
    """On CUDA the copies and the log go to pinned host memory with non_blocking copies: every
    entry into the recorder runs under sync debug mode "error" and only the step's one read
    gets through (test_recorder_sync.recorder_in_sync_error_mode)."""
    from test_recorder_sync import STEPS, recorder_in_sync_error_mode

    device = torch.device("cuda")
    model, crit = M.mlp().to(device), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with recorder_in_sync_error_mode(monkeypatch) as allowed:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2) as rec:
            for step in range(STEPS):
                x, y = (t.to(device) for t in M.batch(step))
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
            assert rec.memory_bytes["rewind_host"] > 0
    assert len(allowed) == STEPS + 1, allowed


# ---------------------------------------------------------------------------------------------
# where the precursors began


def test_a_spike_one_step_into_the_window_is_named_not_the_weights_it_drove(out_dir):
    """An LSTM forecaster whose schedule multiplies the LR by 1e7 from step 9; rewind=4 copies
    at step 8, so the weight norm rises at every step of the window. The window must name the
    spike at step 9, not "the weights began growing before the window"."""
    torch.manual_seed(0)
    model = R.make_forecaster()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e7 if s >= 9 else 1.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, lr_scheduler=sched, factory="rewind_models:make_forecaster",
                            out_dir=out_dir, rewind=4):
            for _ in range(30):
                x = torch.randn(16, 5, 8)
                loss = nn.functional.mse_loss(model(x), x.sum(dim=(1, 2)).unsqueeze(1))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
    assert info.value.event["step"] == 13
    w = nanreplay(info.value.bundle_path)["window"]
    assert w["reproduced"] and w["steps"] == [8, 13]
    norms = [s["param_norm"] for s in w["per_step"][:5]]
    assert all(a < b for a, b in zip(norms, norms[1:]))  # the weights rose at every step
    assert (w["precursors_began"]["step"], w["precursors_began"]["kind"]) == (9, "lr_jump")


def test_a_rise_at_a_steady_pace_began_before_the_window_one_that_took_off_began_there():
    from replay.window import precursors_began

    steady = [{"step": 20 + i, "param_norm": 3.0 * 2.0 ** i} for i in range(8)]
    began = precursors_began(steady)
    assert (began["step"], began["kind"]) == (20, "param_norm_rise")
    assert began["detail"].endswith("it began before the window")
    took_off = [{"step": 20 + i, "loss": v}
                for i, v in enumerate([1.0, 1.01, 1.02, 1.03, 1.9, 3.6, 6.9, 13.0, 25.0])]
    began = precursors_began(took_off)
    assert (began["step"], began["kind"]) == (24, "loss_rise")
    assert "before the window" not in began["detail"]


def test_a_run_diverging_before_the_window_is_no_jump_at_its_second_step():
    """A OneCycleLR whose max_lr is 100x too large: by the window's first step the loss grows
    ~1e3x a step. The gradient norm's one-step ratio at the window's second step (1.2e4x a
    median of one value) was named as a jump there, hiding that it began before the window."""
    from replay.window import precursors_began

    loss = [3.7e13, 2.8e16, 3.2e19, 5.2e22, 1.1e26, 3.3e29, 1.3e33]
    grad = [6.3e9, 7.4e13, 4.7e15, 1.3e19, 7.3e23, 5.2e15, 3.3e29]
    lr = [0.40, 0.48, 0.58, 0.68, 0.80, 0.92, 1.06]
    steady = [{"step": 6 + i, "loss": a, "grad_norm": b, "lr": c}
              for i, (a, b, c) in enumerate(zip(loss, grad, lr))]
    began = precursors_began(steady)
    assert (began["step"], began["kind"]) == (6, "loss_rise"), began
    assert began["detail"].endswith("it began before the window")


def test_the_window_reapplies_the_loops_own_gradient_clipping(out_dir):
    """A heteroscedastic regressor at lr=3 whose loop clips every gradient to norm 1: its
    log-variance drifts until exp(-logvar) overflows at step 9. The loop's clip_grad_norm_ is
    no optimizer setting: left out, the window's re-run ran away at an earlier step ('first
    non-finite at step 4, not the recorded event'). The re-run re-applies it (the recorded
    norms the updates used show it), and the tries clip as the loop did."""
    torch.manual_seed(0)
    model, crit = R.make_hetero_regressor(), R.GaussianNLL()
    opt = torch.optim.SGD(model.parameters(), lr=3.0, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="rewind_models:make_hetero_regressor"):
            for s in range(40):
                x, y = R.regression_batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (9, "loss")
    rep = nanreplay(err.bundle_path, "lr=0.01x", "lr=1x")
    assert (rep["origin"]["op"], rep["cause"]) == ("aten.exp", "overflow")
    w = rep["window"]
    assert w["reproduced"] and w["event_step"] == 9, w
    assert w["loop_clip"] == pytest.approx(1.0, rel=1e-4)
    tries = what_if(rep)
    assert tries["lr=0.01x"]["finite"]
    # no change but a what-if's own backward: clipped as the loop did, the event at step 9
    assert not tries["lr=1x"]["finite"] and tries["lr=1x"]["event_step"] == 9, tries["lr=1x"]


def test_drop_removes_the_samples_rows_from_a_flattened_language_model_target(out_dir):
    """A language model's loss is crit(logits.view(-1, V), labels.view(-1)): the labels are
    (B*T,), not (B, T). drop=2 removed sample 2 from the ids and so from the re-computed
    logits (24 rows) but not from the labels (32): the replay failed ('Expected input
    batch_size (24) to match target batch_size (32)'), exit 2, with no report at all."""
    import replay_models as RM

    torch.manual_seed(0)
    model, crit = RM.make_tiny_gpt(), nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_tiny_gpt"):
            for s in range(6):
                idx, pad, y = RM.token_batch(s)
                if s == 3:
                    pad[2] = True  # an empty document: every key masked
                opt.zero_grad()
                logits = model(idx, pad)
                crit(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["samples"]) == (3, [2])
    rep = nanreplay(info.value.bundle_path, "drop=2", "drop=1")
    assert (rep["origin"]["op"], rep["cause"]) == ("aten._softmax", "invalid")
    tries = what_if(rep)
    assert tries["drop=2"]["finite"] and not tries["drop=2"]["inconclusive"]
    assert not tries["drop=1"]["finite"] and tries["drop=1"]["event_step"] == 3


def test_drop_removes_the_named_samples_from_their_micro_batch_only(out_dir):
    """Gradient accumulation over a 4-sample and a 16-sample micro-batch (a loader's uneven
    split), a NaN in row 6 of micro-batch 1: the report names sample 6 of micro-batch 1.
    drop=6 was refused ('the batch has 4 samples (0-3)', micro-batch 0's size), and drop=3
    removed row 3 of micro-batch 0 as well (another sample, finite)."""
    import replay_models as RM

    from replay.load import read_step
    from replay.rebuild import build
    from replay.whatif import parse_try
    from replay.window import _sub_step, step_as_window

    torch.manual_seed(0)
    model, crit = RM.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_mlp"):
            for s in range(4):
                opt.zero_grad()
                for mb, n in enumerate((4, 16)):
                    x, y = RM.batch(2 * s + mb, n=n)
                    if (s, mb) == (2, 1):
                        x[6, 1] = float("nan")
                    (crit(model(x), y) / 2).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (2, "input", 1, [6])
    rep = nanreplay(info.value.bundle_path, "drop=6")
    assert what_if(rep)["drop=6"]["finite"]
    step = read_step(info.value.bundle_path)
    build(step, None, None)
    win = step_as_window(step)
    _, change = parse_try("drop=3")
    change.drop_step, change.drop_micro_batch = 2, (1,)
    sub = _sub_step(step, win, win.records[0], change)
    rows = [sub.tensors[next(iter(mb["paths"]))].shape[0] for mb in sub.micro_batches]
    assert rows == [4, 15]


def test_drop_without_a_loss_to_rerun_backpropagates_the_recorded_output_gradients(out_dir):
    """The loss computed inline in the loop (no loss_fn), two accumulated micro-batches, an
    all-zero row 3 in micro-batch 1 whose sqrt has an infinite derivative. A drop used to
    strip the recorded output gradients with nothing to recompute them from: no backward ran
    and every drop was 'finite', drop=5 (a finite sample) too. Without the dropped rows, the
    recorded gradients are back-propagated: only dropping sample 3 is finite."""
    import replay_models as RM

    torch.manual_seed(0)
    model = RM.make_length_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, factory="replay_models:make_length_net"):
            for s in range(4):
                opt.zero_grad()
                for mb in range(2):
                    x, y = RM.batch(2 * s + mb)
                    if (s, mb) == (2, 1):
                        x[3] = 0.0
                    (nn.functional.cross_entropy(model(x), y) / 2).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward")
    rep = nanreplay(info.value.bundle_path, "drop=3", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"]) == ("SqrtBackward0", 1, [3])
    tries = what_if(rep)
    assert tries["drop=3"]["finite"]
    assert not tries["drop=5"]["finite"] and tries["drop=5"]["origin"]["phase"] == "backward"


def test_a_model_returning_its_loss_beside_the_logits_is_replayed_with_its_own_gradients(
        out_dir):
    """model(x, targets=y) returns (logits, loss), the loss computed from the logits; the loop
    backpropagates loss / 2 over two micro-batches. The logits' recorded gradient holds what
    the loss sent them: fed both recorded gradients, the re-run counted that path twice, so
    every re-run gradient was twice the recorded one (and the window's SGD updates too)."""
    torch.manual_seed(0)
    model = R.make_self_loss_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, rewind=4,
                            factory="rewind_models:make_self_loss_classifier"):
            for s in range(8):
                opt.zero_grad()
                for mb in range(2):
                    x, y = R.batch(2 * s + mb)
                    if (s, mb) == (6, 1):
                        x[2, 0] = float("nan")
                    _, loss = model(x, targets=y)
                    (loss / 2).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (6, "input")
    meta, tensors = read_bundle(info.value.bundle_path)
    ring = dict(zip(tensors["ring/steps"].tolist(), tensors["ring/grad_norm"].tolist()))
    w = nanreplay(info.value.bundle_path)["window"]
    assert w["reproduced"] and w["steps"][0] < 6
    rerun = [(s["step"], s["grad_norm"]) for s in w["per_step"] if s["step"] < 6]
    assert rerun and all(g == pytest.approx(ring[k], rel=1e-4) for k, g in rerun), (rerun, ring)
    assert w["loop_clip"] is None


@pytest.mark.parametrize("settings", [{"rewind": 2}, {"guard_optimizer": True}])
def test_an_update_whose_learning_rate_was_nan_says_so(out_dir, settings):
    """A schedule run past its end: np.sqrt of a negative number is nan (with only a
    warning), and the loop writes it into the param groups. The update makes every weight NaN;
    the hint named only 'check the learning rate and schedule, eps, and clip gradients'."""
    torch.manual_seed(0)
    model, crit = R.make_classifier(), nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="rewind_models:make_classifier", **settings):
            for s in range(8):
                for g in opt.param_groups:
                    g["lr"] = 1e-3 * math.sqrt(1 - s / 4) if s <= 4 else math.nan
                x, y = R.batch(s)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (5, "optimizer")
    rep = nanreplay(info.value.bundle_path)
    assert rep["cause"] == "optimizer" and rep["reproduced"], rep["problems"]
    assert "its lr was nan in that update" in rep["hint"], rep["hint"]
    # auto: a tenth of NaN is NaN; the schedule's last finite rate (5e-4 at step 3) is a fix
    tries = what_if(nanreplay(info.value.bundle_path, "auto"))
    assert list(tries) == ["lr=0.0005"], tries
    assert tries["lr=0.0005"]["finite"] is True, tries


def test_drop_removes_rows_of_the_origins_micro_batch_only(out_dir):
    """Gradient accumulation over two micro-batches, a NaN feature in row 2 of each: the report
    names sample 2 of micro-batch 0, so drop=2 must remove that row alone. It removed row 2 of
    every micro-batch (other samples that share the index), which here also dropped micro-batch
    1's bad row and reported the try finite; now the NaN of micro-batch 1 is still there."""
    torch.manual_seed(0)
    model = R.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="rewind_models:make_classifier"):
            for step in range(4):
                opt.zero_grad()
                for mb in range(2):
                    x, y = R.batch(10 * step + mb)
                    if step == 2:
                        x[2, 3] = float("nan")
                    (crit(model(x), y) / 2).backward()
                opt.step()
    rep = nanreplay(info.value.bundle_path, "drop=2", "drop=0")
    assert (rep["cause"], rep["origin"]["samples"], rep["origin"]["micro_batch"]) == \
        ("input", [2], 0)
    tries = what_if(rep)
    assert not tries["drop=2"]["finite"]
    assert tries["drop=2"]["origin"]["micro_batch"] == 1
    assert tries["drop=2"]["origin"]["step"] == 2 and tries["drop=2"]["origin"]["phase"] == "input"
    assert tries["drop=0"]["origin"]["micro_batch"] == 0
    text = invoke_cli(info.value.bundle_path, "--try", "drop=2").stdout
    assert "  what-if    drop=2         nan at step 2 (input, <root> call 0, micro-batch 1)" \
        in text, text


def test_drop_on_a_loop_that_flattens_its_tags_for_the_loss(out_dir):
    """crit(logits.view(-1, C), tags.view(-1)), as token classifiers and language models call
    it: drop=2 removed sample 2 from the input and the output but left the flattened (B*T,)
    tags whole, and the loss refused the mismatch ('replay failed (ValueError: Expected input
    batch_size (28) to match target batch_size (35))'); now sample 2's T tags go with it."""
    torch.manual_seed(0)
    model = R.make_tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="rewind_models:make_tagger"):
            for step in range(4):
                x = torch.randn(5, 7, R.D_IN, generator=g)
                tags = torch.randint(0, R.N_CLASSES, (5, 7), generator=g)
                if step == 2:
                    x[2, 4, 1] = float("nan")
                opt.zero_grad()
                logits = model(x)
                crit(logits.view(-1, R.N_CLASSES), tags.view(-1)).backward()
                opt.step()
    res = invoke_cli(info.value.bundle_path, "--json", "--try", "drop=2", "--try", "drop=0")
    assert res.exit_code == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert (rep["cause"], rep["origin"]["samples"], rep["event"]["step"]) == ("input", [2], 2)
    tries = what_if(rep)
    assert tries["drop=2"]["finite"] is True and tries["drop=2"]["steps"] == [2, 2]
    assert tries["drop=0"]["finite"] is False and tries["drop=0"]["origin"]["phase"] == "input"


def test_a_try_whose_re_run_fails_is_reported_and_the_others_stand(out_dir, monkeypatch):
    """One what-if whose re-run raises in the replay itself (a bug of ours on one change) is
    that try's 'failed' line, one line; the other tries and the report stand. It aborted the
    whole replay with a one-line 'replay failed' and exit 2, losing every other result."""
    import replay.whatif as whatif

    err = rare_tokens(out_dir)
    real = whatif.run_window

    def failing_on_lr(step, win, change=None):
        if change is not None and change.lr_factor is not None:
            raise RuntimeError("shape mismatch\n  with a second line of detail")
        return real(step, win, change)

    monkeypatch.setattr(whatif, "run_window", failing_on_lr)
    rep = nanreplay(err.bundle_path, "eps=1e-8", "lr=0.1x")
    assert rep["cause"] == "optimizer" and rep["reproduced"]
    tries = what_if(rep)
    assert tries["eps=1e-8"]["finite"] is True
    failed = tries["lr=0.1x"]
    assert (failed["finite"], failed["origin"], failed["error"]) == (
        None, None, "RuntimeError: shape mismatch with a second line of detail")
    res = invoke_cli(err.bundle_path, "--try", "eps=1e-8", "--try", "lr=0.1x")
    assert res.exit_code == 0, res.stdout + res.stderr
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("  what-if")] == [
        f"  what-if    eps=1e-8       finite through step 1 (loss {tries['eps=1e-8']['loss']:.4g})",
        "  what-if    lr=0.1x        failed: the re-run with this change raised RuntimeError: "
        "shape mismatch with a second line of detail"]


def test_a_nan_target_recorded_with_a_window_comes_back_from_it(out_dir):
    """A regression target left NaN (a missing value not filtered) at step 5: an input event
    that came in with the loss's arguments. Its window re-run meets it as the step's
    non-finite loss, which the report called 'not the recorded input event at step 5'."""
    torch.manual_seed(0)
    model = R.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=3,
                            factory="rewind_models:make_regressor"):
            for s in range(10):
                x, y = R.regression_batch(s)
                if s == 5:
                    y[7] = float("nan")
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (5, "input", [7])
    rep = nanreplay(err.bundle_path, "drop=7")
    w = rep["window"]
    assert w["reproduced"] and w["event_step"] == 5, w
    assert not any("not the recorded" in p for p in rep["problems"]), rep["problems"]
    assert what_if(rep)["drop=7"]["finite"] is True


@pytest.mark.parametrize("rewind", [2, None])
def test_auto_drops_the_rows_whose_target_is_an_outlier_of_an_overflow(out_dir, rewind):
    """The log-cosh loss written as its formula, and one target recorded in the wrong unit
    (200 where the others are about 1): cosh overflows float32 in that row. ``auto`` looked
    for outliers in the model's inputs only, so it proposed the learning rate and clipping
    (both still +inf) and not the drop that is finite. Without a window, no update runs
    before the event: ``auto`` proposed the learning rate and clipping anyway, each then
    'not re-run'; it proposes only what the re-run can change."""
    import kernel_models as K

    torch.manual_seed(0)
    model = R.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = K.LogCoshLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                            factory="rewind_models:make_regressor"):
            for s in range(10):
                x, y = R.regression_batch(s)
                y = y[:, 0] / 8
                if s == 4:
                    y[7] = 200.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    rep = nanreplay(info.value.bundle_path, "auto")
    assert (rep["cause"], rep["origin"]["op"], rep["origin"]["samples"]) == \
        ("overflow", "aten.cosh", [7]), rep["origin"]
    tries = what_if(rep)
    assert tries["drop=7"]["finite"] is True, tries
    assert set(tries) == ({"drop=7", "dtype=float64", "lr=0.1x", "clip=1.0"} if rewind
                          else {"drop=7", "dtype=float64"}), tries


def test_window_first_line_gives_the_kind_the_batch_brought(out_dir):
    """A +inf feature in one record: the first layer passes +-inf on, the head sums them to
    NaN. The window's first non-finite step is the input's, and it is the batch's +inf (the
    report's origin) that the window's line and JSON name, not the NaN the layers made of it."""
    at, row = 4, 3
    torch.manual_seed(0)
    model = R.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2,
                            factory="rewind_models:make_classifier"):
            for step in range(at + 2):
                x, y = R.batch(step)
                if step == at:
                    x[row, 1] = math.inf
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (at, "input")
    report = nanreplay(info.value.bundle_path)
    assert (report["origin"]["made"], report["origin"]["samples"]) == ("+inf", [row])
    first = report["window"]["first_non_finite"]
    assert (first["step"], first["phase"], first["kind"]) == (at, "input", "+inf")
    text = invoke_cli(info.value.bundle_path).stdout
    assert f"first      step {at}: +inf in the input" in text
