"""What-if trials: a user got a bundle and asks ``nanreplay --try KEY=VALUE`` whether a change
would have kept training finite. Each test re-trains from the same state with the same change
(``what_if_trials_models.Trial``) and holds the try's answer (finite, or the step of the first
non-finite value) against what training does.

Before: an optimizer event found after its update (Adam's first update of float16 weights,
``rewind=N`` without ``guard_optimizer``) whose window's log held that step's batch was
refused as "the bundle holds no batch of that step", so the op was not named; SGD's coupled
weight decay with ``lr * weight_decay`` past its stability bound was reported as a generic
divergence (lower the learning rate or clip; clipping cannot stop it) and ``--try auto`` did not
try ``wd``; one batch's exploding gradient through a ReLU RNN got the same generic advice, though
``--try lr=0.1x`` does not save it and ``--try clip=1.0`` does. The float16 Adam event stops the
loop at its own check of the weights, so the recorder's detach finds it after the update."""

from __future__ import annotations

import pytest
import torch
import what_if_trials_models as M
from bundles import invoke_cli, nanreplay_json, one_error_line, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "what_if_trials_models.py"


def recorded(out_dir, factory: str, loop, rewind=None, guard=False, **kw):
    """Run ``loop`` under the recorder (as a user does); the bundle of its event."""
    def recorder(model, opt, crit):
        return FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=rewind,
                              guard_optimizer=guard,
                              factory=f"what_if_trials_models:{factory}")
    with pytest.raises(NonFiniteError) as info:
        loop(recorder=recorder, **kw)
    return info.value.bundle_path


def tries(rep: dict) -> dict[str, dict]:
    return {t["try"]: t for t in rep["what_if"]}


def verdict(t: dict):
    """What a try says: None (finite through its window) or the step of its first event."""
    assert t["finite"] is not None and not t["inconclusive"], t
    return None if t["finite"] else t["event_step"]


def test_adam_eps_under_float16_weights_guarded(out_dir):
    b = recorded(out_dir, "make_rate_head", M.train_half_adam, guard=True)
    rep = nanreplay_json(b, "--try", "auto", "--try", "lr=0.1x")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["op"], rep["cause"]) == \
        (0, "optimizer", "aten.addcdiv_", "optimizer")
    assert "eps=1e-08 is 0 in float16" in rep["hint"] and "set eps=1e-4" in rep["hint"]
    t = tries(rep)
    assert list(t) == ["lr=0.1x", "clip=1.0", "eps=1e-4", "dtype=float32"], list(t)
    assert verdict(t["eps=1e-4"]) is None
    assert M.train_half_adam(trial=M.Trial(start=0, eps=1e-4), steps=1) is None
    assert verdict(t["dtype=float32"]) is None
    assert M.train_half_adam(trial=M.Trial(start=0, dtype=torch.float32), steps=1) is None
    for label, trial in (("lr=0.1x", M.Trial(start=0, lr_factor=0.1)),
                         ("clip=1.0", M.Trial(start=0, clip=1.0))):
        # (a smaller rate or step divides by the same 0)
        assert verdict(t[label]) == 0 == M.train_half_adam(trial=trial, steps=1), label


def test_adam_eps_under_float16_found_after_the_update_is_re_run_from_the_window(out_dir):
    """Linear probing, then the whole float16 model unfrozen at step 5: the body's first Adam
    update divides by eps=1e-8, 0 in float16. Without guard_optimizer the event is found after
    the update; the window's log holds that step's batch, so the update is re-run from the
    copy and its op named (it was refused: 'the bundle holds no batch of that step')."""
    b = recorded(out_dir, "make_rate_head", M.train_half_adam, rewind=4, scale=0.1,
                 unfreeze_at=5)
    rep = nanreplay_json(b, "--try", "auto", "--try", "eps=1e-8")
    o, w = rep["origin"], rep["window"]
    assert (o["phase"], o["op"], o["step"], o["params"], rep["cause"]) == \
        ("optimizer", "aten.addcdiv_", 5, ["body.0.weight", "body.0.bias"], "optimizer")
    assert rep["reproduced"] and w["reproduced"] and w["steps"] == [0, 5]
    assert "(re-run from the rewind window); eps=1e-08 is 0 in float16" in rep["hint"]
    assert "it made only row(s) 3, 4, 8, 10, 14, 15 of 16 of body.0.weight" in rep["hint"]
    assert o["rows"] == [3, 4, 8, 10, 14, 15]
    assert not any("window was not re-run" in p for p in rep["problems"])
    t = tries(rep)
    assert list(t) == ["lr=0.1x", "clip=1.0", "eps=1e-4", "dtype=float32", "eps=1e-8"], list(t)
    for label, trial in (("eps=1e-4", M.Trial(start=0, eps=1e-4)),
                         ("dtype=float32", M.Trial(start=0, dtype=torch.float32)),
                         ("lr=0.1x", M.Trial(start=0, lr_factor=0.1)),
                         ("clip=1.0", M.Trial(start=0, clip=1.0)),
                         ("eps=1e-8", M.Trial(start=0, eps=1e-8))):
        losses: list[float] = []
        assert verdict(t[label]) == M.train_half_adam(
            trial=trial, steps=6, scale=0.1, unfreeze_at=5, losses=losses), label
        if t[label]["finite"]:  # (the window's last loss: step 5's, trained so from step 0;
            # float32 from the recorded float16 batch, not the loader's float32 one: 2e-6 off)
            assert t[label]["loss"] == pytest.approx(losses[-1], rel=1e-4), label


def test_a_learning_rate_that_diverges_over_steps(out_dir):
    b = recorded(out_dir, "make_mlp", M.train_sgd, rewind=8, lr=0.15)
    rep = nanreplay_json(b, "--try", "auto", "--try", "lr=2x")
    o, w = rep["origin"], rep["window"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (17, "loss", "<loss>", "aten.mse_loss", "overflow")
    assert w["steps"] == [8, 17] and w["reproduced"] and w["precursors_began"]["step"] == 14
    assert "the run was diverging" in rep["hint"] and "--try lr=0.1x" in rep["hint"]
    assert "exploding gradient" not in rep["hint"]  # (a climb over steps, no one batch's spike)
    assert not any("before the window's copy" in p for p in rep["problems"])
    t = tries(rep)
    assert list(t) == ["dtype=float64", "lr=0.1x", "clip=1.0", "lr=2x"], list(t)
    for label, trial in (("lr=0.1x", M.Trial(start=8, lr_factor=0.1)),
                         ("lr=2x", M.Trial(start=8, lr_factor=2.0)),
                         ("clip=1.0", M.Trial(start=8, clip=1.0))):
        assert verdict(t[label]) == M.train_sgd(lr=0.15, trial=trial, steps=18), label
    assert verdict(t["lr=2x"]) == 14
    assert t["clip=1.0"]["diverging"] and not t["lr=0.1x"]["diverging"]
    assert t["dtype=float64"]["beyond"] == "float32"  # (finite in float64 only)
    text = invoke_cli(b, "--try", "lr=0.1x", "--try", "lr=2x").stdout.splitlines()
    assert "  what-if    lr=0.1x        finite through step 17 (loss 4.487)" in text
    assert "  what-if    lr=2x          +inf at step 14 (forward, 2 call 0)" in text


def test_a_window_copied_after_the_growth_began_says_its_tries_start_too_late(out_dir):
    """rewind=1: the window starts at step 16, the gradient norm jumped at step 10. A tenth of
    the rate from step 16 is finite through step 17 but still diverging (re-trained, it
    overflows at step 18); from step 10 it trains on finite: the note says the copy came too
    late and which rewind holds one from before the growth."""
    b = recorded(out_dir, "make_mlp", M.train_sgd, rewind=1, lr=0.15)
    rep = nanreplay_json(b, "--try", "lr=0.1x")
    assert rep["window"]["steps"] == [16, 17] and rep["event"]["step"] == 17
    assert "the run began to grow at step 10 (a gradient norm jump, see precursors), before " \
           "the window's copy at step 16: every try starts from weights that growth had " \
           "already reached" in " ".join(rep["problems"])
    assert "rewind=N), N of 7 or more" in " ".join(rep["problems"])
    (t,) = rep["what_if"]
    assert verdict(t) is None and t["diverging"]
    assert M.train_sgd(lr=0.15, trial=M.Trial(start=16, lr_factor=0.1), steps=60) == 18
    assert M.train_sgd(lr=0.15, trial=M.Trial(start=10, lr_factor=0.1), steps=60) is None
    # (a window copied before the growth has no such note: the lr test's, rewind=8)


def test_a_weight_decay_too_large_for_sgd_is_named_and_auto_tries_wd(out_dir):
    """SGD(lr=0.05, momentum=0.9, weight_decay=100): a prior's precision not divided by the
    data set's size; lr * wd = 5 > 2 (1 + 0.9), so the decay term alone grows the weights."""
    b = recorded(out_dir, "make_mlp", M.train_sgd, rewind=4, lr=0.05, weight_decay=100.0)
    rep = nanreplay_json(b, "--try", "auto")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (6, "forward", "2", "aten.addmm", "overflow")
    assert o["samples"] == [1, 4, 10, 12, 15]
    assert "SGD's weight_decay=100 at lr=0.05, momentum 0.9 makes lr * weight_decay 5, above " \
           "the 3.8 where the decay term" in rep["hint"]
    assert "clipping does not stop it" in rep["hint"] and "--try wd=0" in rep["hint"]
    t = tries(rep)
    assert list(t) == ["dtype=float64", "lr=0.1x", "clip=1.0", "wd=0"], list(t)
    assert M.train_sgd(lr=0.05, weight_decay=100.0, steps=7) == 6
    for label, trial in (("wd=0", M.Trial(start=0, wd=0.0)),
                         ("lr=0.1x", M.Trial(start=0, lr_factor=0.1)),
                         ("clip=1.0", M.Trial(start=0, clip=1.0))):
        assert verdict(t[label]) == \
            M.train_sgd(lr=0.05, weight_decay=100.0, trial=trial, steps=7), label
    assert t["clip=1.0"]["diverging"] and not t["wd=0"]["diverging"]


def test_log_of_a_zero_target_in_a_log_space_loss(out_dir):
    b = recorded(out_dir, "make_positive_head", M.train_log_mse)
    rep = nanreplay_json(b, "--try", "auto", "--try", "drop=3", "--try", "dtype=float64")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (M.BAD_STEP, "loss", "<loss>", "aten.log", "invalid")
    assert o["samples"] == list(M.ZERO_ROWS)
    assert o["source"] == source_line(MODELS, "log(0) of a target 0")
    assert rep["event"]["tensor"] is None and "loss_args[1] is 0" in rep["hint"]
    assert "--try drop=3,9" in rep["hint"]
    t = tries(rep)
    assert list(t) == ["drop=3,9", "drop=3", "dtype=float64"], list(t)
    assert verdict(t["drop=3,9"]) is None
    losses: list[float] = []  # (re-trained without those rows: the try's loss, as it says)
    assert M.train_log_mse(drop=M.ZERO_ROWS, steps=M.BAD_STEP + 1, losses=losses) is None
    assert t["drop=3,9"]["loss"] == pytest.approx(losses[-1], rel=1e-6)
    assert verdict(t["drop=3"]) == M.BAD_STEP
    assert M.train_log_mse(drop=M.ZERO_ROWS[:1], steps=M.BAD_STEP + 1) == M.BAD_STEP
    assert verdict(t["dtype=float64"]) == M.BAD_STEP  # (log(0) is -inf in any type)
    assert M.train_log_mse(trial=M.Trial(start=M.BAD_STEP, dtype=torch.float64),
                           steps=M.BAD_STEP + 1) == M.BAD_STEP


def test_exp_overflow_under_float16_autocast(out_dir):
    b = recorded(out_dir, "make_poisson_rate", M.train_autocast)
    rep = nanreplay_json(b, "--try", "auto", "--try", "lr=0.1x")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (2, "forward", "", "aten.exp", "overflow")
    assert (o["samples"], o["dtype"]) == ([M.HOT_ROW], "float16")
    assert o["source"] == source_line(MODELS, "rate = torch.exp(self.eta(x))")
    t = tries(rep)
    assert list(t) == ["dtype=float32", "lr=0.1x"], list(t)
    assert verdict(t["dtype=float32"]) is None
    assert M.train_autocast(steps=3) == 2
    assert M.train_autocast(trial=M.Trial(start=2, dtype=torch.float32), steps=3) is None
    # (no window: the step's own update comes after the event, so no rate can change it)
    assert t["lr=0.1x"]["finite"] is None and "rewind=N" in t["lr=0.1x"]["note"]


def test_a_rate_past_float16_under_amp_with_a_grad_scaler(out_dir):
    """Counts whose busiest hours pass 65504: the learned rate exp(eta), float16 under
    autocast, overflows once training gets there (no divergence: lr=0.1x only trains slower,
    and stays finite through step 63 too)."""
    def recorder(model, opt, crit, scaler):
        return FlightRecorder(model, opt, loss_fn=crit, scaler=scaler, out_dir=out_dir,
                              rewind=8, factory="what_if_trials_models:make_count_model")
    with pytest.raises(NonFiniteError) as info:
        M.train_counts(recorder=recorder)
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto", "--try", "lr=0.1x",
                         "--try", "clip=1.0")
    o, w = rep["origin"], rep["window"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (30, "forward", "", "aten.exp", "overflow")
    assert (o["samples"], o["dtype"]) == ([0, 13], "float16")
    assert w["steps"] == [16, 30] and w["reproduced"]
    t = tries(rep)
    assert list(t) == ["dtype=float32", "lr=0.1x", "clip=1.0"], list(t)
    for label, trial in (("dtype=float32", M.Trial(start=16, dtype=torch.float32)),
                         ("lr=0.1x", M.Trial(start=16, lr_factor=0.1)),
                         ("clip=1.0", M.Trial(start=16, clip=1.0))):
        losses: list[float] = []
        assert verdict(t[label]) is M.train_counts(trial=trial, steps=31, losses=losses) \
            is None, label
        assert t[label]["loss"] == pytest.approx(losses[-1], rel=1e-4), label
    assert M.train_counts(trial=M.Trial(start=16, lr_factor=0.1), steps=64) is None


def test_exploding_gradients_of_a_recurrence_without_clipping(out_dir):
    b = recorded(out_dir, "make_sequence_regressor", M.train_rnn, rewind=4)
    rep = nanreplay_json(b, "--try", "auto", "--try", "clip=1e6")
    o, w = rep["origin"], rep["window"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (M.SPIKE_STEP + 1, "loss", "<loss>", "aten.mse_loss", "overflow")
    assert w["steps"] == [0, 7] and w["precursors_began"]["step"] == M.SPIKE_STEP
    # (one batch's gradient, 8000x the run's: clipping bounds it, a tenth of it is no fix)
    assert "the gradient norm at step 6 was 2.03e+06, 7.97e+03x the median 254 of the steps " \
           "before" in rep["hint"]
    assert "clipping the gradient norm between backward() and step() bounds such an update " \
           "whatever its size" in rep["hint"]
    assert "(--try clip=1.0 re-runs the window with it)" in rep["hint"]
    t = tries(rep)
    assert list(t) == ["dtype=float64", "lr=0.1x", "clip=1.0", "clip=1e6"], list(t)
    for label, trial in (("clip=1.0", M.Trial(start=0, clip=1.0)),
                         ("clip=1e6", M.Trial(start=0, clip=1e6)),
                         ("lr=0.1x", M.Trial(start=0, lr_factor=0.1))):
        assert verdict(t[label]) == M.train_rnn(trial=trial, steps=8), label
    assert verdict(t["clip=1.0"]) is None and verdict(t["lr=0.1x"]) == 7


def test_bad_tries_are_one_line_errors_naming_the_keys_the_optimizer_takes(out_dir):
    b = recorded(out_dir, "make_mlp", M.train_sgd, rewind=4, lr=0.05, weight_decay=100.0)
    line = one_error_line(invoke_cli(b, "--json", "--try", "eps=1e-8"))
    assert line == "nanreplay: --try eps=1e-8: SGD has no 'eps' setting; try another key " \
                   "(lr, wd, clip)"
    for value, says in (("momentum=0.5", "expected KEY=VALUE with KEY one of lr, eps"),
                        ("wd=-1", "is not a weight decay such as 0.01"),
                        ("drop=16", "the batch has 16 samples (0-15)")):
        line = one_error_line(invoke_cli(b, "--json", "--try", value))
        assert says in line, line
    html = out_dir / "r.html"
    assert invoke_cli(b, "--try", "wd=0", "--html", html).exit_code == 0
    page = html.read_text()
    assert "<h2>What if</h2>" in page and "<code>wd=0</code></td><td>finite through step 6" \
        in page


def test_healthy_run_raises_no_event_and_trains_bit_identically(out_dir):
    def train(record: bool):
        model = M.make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        crit = nn.MSELoss()
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                             factory="what_if_trials_models:make_mlp")
        with rec if record else M._nothing():
            for x, y in M.regression_loader(30):
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
        return [p.detach().clone() for p in model.parameters()]
    a, b = train(True), train(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not list(out_dir.glob("*.nan"))


def test_exploding_gradients_without_a_window_say_how_to_test_clipping(out_dir):
    b = recorded(out_dir, "make_sequence_regressor", M.train_rnn)
    rep = nanreplay_json(b, "--try", "clip=1.0")
    assert (rep["event"]["step"], rep["origin"]["op"], rep["cause"]) == \
        (M.SPIKE_STEP + 1, "aten.mse_loss", "overflow")
    assert "the gradient norm at step 6 was 2.03e+06" in rep["hint"]
    assert "(record with FlightRecorder(..., rewind=N) so that --try clip=1.0 re-runs the " \
           "steps from before it)" in rep["hint"]
    (t,) = rep["what_if"]  # (the event step's own update comes after its loss)
    assert t["finite"] is None and "rewind=N" in t["note"]


def test_log_of_a_softmax_that_underflowed_in_a_label_smoothed_loss(out_dir):
    b = recorded(out_dir, "make_classifier", M.train_smoothed, rewind=4)
    rep = nanreplay_json(b, "--try", "auto", "--try", "dtype=float64", "--try", "lr=0.1x")
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], rep["cause"]) == \
        (4, "loss", "<loss>", "aten.log", "underflow")
    assert o["samples"] == [1, 7, 11]
    assert o["source"] == source_line(MODELS, "log(0) of an underflow")
    assert "log_softmax instead of log(softmax)" in rep["hint"]
    t = tries(rep)
    assert list(t) == ["drop=1,7,11", "dtype=float64", "lr=0.1x"], list(t)
    for label, trial in (("dtype=float64", M.Trial(start=0, dtype=torch.float64)),
                         ("lr=0.1x", M.Trial(start=0, lr_factor=0.1))):
        losses: list[float] = []
        assert verdict(t[label]) is M.train_smoothed(trial=trial, steps=5, losses=losses) \
            is None, label
        assert t[label]["loss"] == pytest.approx(losses[-1], rel=1e-5), label
    # (finite through the window only: float64 at this rate overflows at step 8)
    assert M.train_smoothed(trial=M.Trial(start=0, dtype=torch.float64), steps=9) == 8
