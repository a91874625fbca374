"""Loss modules that call the model again inside their own call (``loss_forward_models``):
WGAN-DRAGAN's penalty on perturbed reals, a consistency loss on a posterized strong view, a
Hutchinson Hessian penalty through ``autograd.functional.hvp``. The recorder numbers every call
of the model a micro-batch, so the event named "micro-batch 2" or "the loss of micro-batch 1"
in a loop with one forward per loss term, without saying that this is the loss's own call of
the model; and a forward event the replay could not bring back was blamed on "the loop
differentiated the model's output itself (... outside loss_fn)", with the hint to move the
gradient penalty into the loss, where it already was. Healthy runs train bit-identically."""

from __future__ import annotations

import contextlib
import logging

import loss_forward_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError
from replay.load import read_step
from replay.rebuild import build

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS, BAD_STEP, BAD_ROW = 5, 3, 5
IN_LOSS = "the loss's own call of the model"


def recording(parts, opt, factory: str, out_dir):
    if out_dir is None:
        return contextlib.nullcontext()
    return FlightRecorder(parts["model"], opt, loss_fn=parts["loss_fn"], out_dir=out_dir,
                          factory=f"loss_forward_models:{factory}")


def dragan(out_dir, plant=None):
    """The critic's loop: two forwards, then the loss (whose penalty calls the critic again).
    Returns the losses or the error, and the first (step, rows) whose perturbed reals left the
    domain of the critic's sqrt (x + 3/8 < 0), as the loss drew them."""
    parts = M.make_dragan()
    critic, loss_fn = parts["model"], parts["loss_fn"]
    opt = torch.optim.Adam(critic.parameters(), 1e-3, betas=(0.5, 0.9))
    torch.manual_seed(1)
    losses, bad = [], None
    try:
        with recording(parts, opt, "make_dragan", out_dir):
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step)
                real = torch.poisson(torch.full((8, M.D), 5.0), generator=g) + 4
                fake = torch.rand(8, M.D, generator=g) * 10
                if step == BAD_STEP and plant == "blank":
                    real[BAD_ROW] = 0  # an empty record: DRAGAN's noise drives it below 0
                opt.zero_grad()
                d_real, d_fake = critic(real), critic(fake)
                critic.trap = step == BAD_STEP and plant == "flag"
                loss = loss_fn(d_real, d_fake, real)
                critic.trap = False
                rows = (loss_fn.x_hat + 3 / 8 < 0).any(1).nonzero().flatten().tolist()
                bad = bad or ((step, rows) if rows else None)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e, bad
    return losses, bad


def one_forward(factory: str, out_dir, plant=None):
    """A loop with one forward and a loss that runs the model itself: the consistency loss
    (``blank_strong``: a low-contrast row that posterizes to one level; ``blank``: a constant
    row), the Hessian penalty (``unlabelled``: a batch with no labelled row) or VAT
    (``saturated``: a row whose output no perturbation moves)."""
    parts = getattr(M, factory)()
    model, loss_fn = parts["model"], parts["loss_fn"]
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    torch.manual_seed(1)
    losses = []
    try:
        with recording(parts, opt, factory, out_dir):
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step)
                x = torch.rand(8, model_width(model), generator=g)
                y = torch.randint(0, 3, (8,), generator=g)
                if step == BAD_STEP and plant == "blank_strong":
                    x[BAD_ROW] = torch.linspace(0.05, 0.45, x.shape[1])
                if step == BAD_STEP and plant == "blank":
                    x[BAD_ROW] = 0.25
                if step == BAD_STEP and plant == "unlabelled":
                    y[:] = -1
                if step == BAD_STEP and plant == "saturated":
                    x[BAD_ROW] *= 1e4  # every tanh saturates: the row's logits cannot move
                opt.zero_grad()
                loss = loss_fn(model(x), y, x)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e
    return losses


def model_width(model) -> int:
    return next(model.parameters()).shape[1]


@pytest.mark.parametrize("run", [dragan, lambda d: (one_forward("make_consistency", d), None),
                                 lambda d: (one_forward("make_hessian", d), None),
                                 lambda d: (one_forward("make_vat", d), None)],
                         ids=["dragan", "consistency", "hessian", "vat"])
def test_healthy_runs_train_the_same_and_raise_nothing(tmp_path, run, caplog):
    plain, _ = run(None)
    recorded, _ = run(tmp_path)
    assert isinstance(recorded, list) and recorded == plain
    assert not list(tmp_path.iterdir())
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_dragan_penalty_on_a_blank_record_names_the_losss_critic_call(tmp_path):
    err, bad = dragan(tmp_path, plant="blank")
    assert isinstance(err, NonFiniteError) and bad is not None
    step, rows = bad
    ev = err.event  # (the loop's two forwards are micro-batches 0 and 1; the loss's call, 2)
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        (step, "forward", "", 2, rows)
    assert ev["forward_in_loss"] is True
    assert f"(loss_forward_models.Critic, call 0, micro-batch 2, {IN_LOSS})" in str(err)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert (o["phase"], o["module"], o["op"], o["micro_batch"], o["samples"]) == \
        ("forward", "", "aten.sqrt", 2, rows)
    assert o["forward_in_loss"] is True
    assert o["source"].startswith(source_line("loss_forward_models.py", "torch.sqrt(x + 3 / 8)"))
    # the blank record (a loss argument) is named; the perturbed reals the loss made from it,
    # the critic call's input, are no data "out of its range"
    assert f"is 0 everywhere in sample(s) {BAD_ROW} and not in any other" in rep["hint"], rep
    assert "out of its range" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("plant", ["blank_strong", "blank"])
def test_consistency_view_names_which_call_made_it(tmp_path, plant):
    """The strong view the loss makes (micro-batch 1, the loss's call) or the loop's own
    forward (micro-batch 0, no such words) divides a constant row by its std of 0."""
    err = one_forward("make_consistency", tmp_path, plant)
    assert isinstance(err, NonFiniteError)
    in_loss = plant == "blank_strong"
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        (BAD_STEP, "forward", "norm", int(in_loss), [BAD_ROW])
    assert ev.get("forward_in_loss", False) is in_loss and (IN_LOSS in str(err)) is in_loss
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert (o["module"], o["op"], o["micro_batch"], o["samples"], o["forward_in_loss"]) == \
        ("norm", "aten.div", int(in_loss), [BAD_ROW], in_loss)


def test_hessian_penalty_loss_on_an_unlabelled_batch_is_the_losss_not_a_second_batch(tmp_path):
    err = one_forward("make_hessian", tmp_path, "unlabelled")
    assert isinstance(err, NonFiniteError)
    ev = err.event  # (hvp's call of the model is micro-batch 1, and the loss is filed there)
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == \
        (BAD_STEP, "loss", "<loss>", 1)
    assert f"Made in the loss (filed under micro-batch 1, {IN_LOSS})." in str(err)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert (o["phase"], o["module"], o["op"], o["forward_in_loss"]) == \
        ("loss", "<loss>", "aten.div", True)
    assert o["source"].startswith(source_line("loss_forward_models.py", "/ known.sum()"))


def test_unreproduced_event_in_the_losss_critic_call_is_not_blamed_on_the_loop(tmp_path):
    """A flag the loop sets around the loss call is state the replay does not have: the event
    does not come back, and the report says so, not that the loop differentiated the output
    outside loss_fn (the loss did, and the replay re-ran it)."""
    err, _ = dragan(tmp_path, plant="flag")
    assert isinstance(err, NonFiniteError)
    assert (err.event["step"], err.event["micro_batch"]) == (BAD_STEP, 2)
    rep = nanreplay_json(err.bundle_path, code=None)
    assert not rep["reproduced"] and rep["cause"] == "not_reproduced", rep
    text = " ".join([rep["hint"] or "", *rep["problems"]])
    assert "outside loss_fn" not in text and "inside the loss" not in text, text


def test_vat_direction_of_a_saturated_row_is_the_losss_0_over_0(tmp_path):
    """VAT's second call of the model (micro-batch 2) takes x + eps * g / |g|, with g exactly 0
    on a row whose every tanh saturates: the loss made that input's NaN, not the data nor the
    loop (which the hint said before)."""
    err = one_forward("make_vat", tmp_path, "saturated")
    assert isinstance(err, NonFiniteError)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"], ev["samples"]) == \
        (BAD_STEP, "input", "", 2, [BAD_ROW])
    assert f"input of '<root>' (micro-batch 2, {IN_LOSS})" in str(err)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and rep["cause"] == "input", rep
    assert (o["micro_batch"], o["samples"], o["forward_in_loss"]) == (2, [BAD_ROW], True)
    assert rep["hint"].startswith(
        "batch of micro-batch 2 is no data: the loss made it between the step's forwards from "
        "the input of micro-batch 1, which was finite and which the loss differentiated"), rep


def test_loss_function_reading_the_model_from_a_global_calls_the_rebuilt_model(tmp_path):
    """``rec.loss_fn`` given a module-level function that calls the script's ``critic``: the
    replay imported the function, whose module global is another model than the rebuilt one
    (the re-run's penalty ran on weights the replay does not watch)."""
    M.critic.load_state_dict(M.make_critic().state_dict())
    opt = torch.optim.Adam(M.critic.parameters(), 1e-3, betas=(0.5, 0.9))
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(M.critic, opt, loss_fn=M.dragan_loss, out_dir=tmp_path,
                            factory="loss_forward_models:make_critic") as rec:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step)
                real = torch.poisson(torch.full((8, M.D), 5.0), generator=g) + 4
                if step == BAD_STEP:
                    real[BAD_ROW] = 0
                opt.zero_grad()
                loss = rec.loss_fn(M.critic(real), M.critic(real.flip(0)), real)
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["forward_in_loss"]) == (BAD_STEP, 2, True)
    step = read_step(info.value.bundle_path, None)
    build(step, None, None, None)
    calls = []
    step.model.register_forward_hook(lambda m, a, o: calls.append(m))
    real = torch.ones(8, M.D)
    step.loss_fn(step.model(real), step.model(real), real)
    assert len(calls) == 3 and M.critic is not step.model  # (the penalty's call: the third)
