"""A loss module whose parameters the model's optimizer trains (a learned temperature, as
CLIP's ``logit_scale``; a multi-task loss's log-variances): recorded, checked, bundled and
replayed with the model's, named ``<loss>.NAME``. The recorder refused such a run at attach
("move them into the model"), so it could not be recorded at all."""

from __future__ import annotations

import infinity_models as I
import objective_models as O
import pytest
import rewind_models as R
import torch
from test_rewind import _rare_batch, nanreplay, what_if

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle


def _late_input(out_dir) -> NonFiniteError:
    """An auxiliary input joins at step 5 with a dead channel: Adam(eps=0)'s first update of
    ``aux.weight`` is 0/0 in that column, caught with step 6's read. A learned temperature in
    the loss, trained by the same Adam."""
    torch.manual_seed(0)
    model, crit = R.make_fusion(), O.LearnedTemperatureCE()
    opt = torch.optim.Adam([*model.parameters(), *crit.parameters()], lr=1e-2, eps=0.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="rewind_models:make_fusion"):
            for s in range(20):
                args, kwargs, y = R.aux_batch(s)
                opt.zero_grad()
                crit(model(*args, **kwargs), y).backward()
                opt.step()
    return info.value


def _late_input_loss(steps: int, train_temperature: bool) -> float:
    """The loss at the last of ``steps`` steps of that loop with Adam(eps=1e-8)."""
    torch.manual_seed(0)
    model, crit = R.make_fusion(), O.LearnedTemperatureCE()
    params = [*model.parameters(), *(crit.parameters() if train_temperature else [])]
    opt = torch.optim.Adam(params, lr=1e-2, eps=1e-8)
    for s in range(steps):
        args, kwargs, y = R.aux_batch(s)
        opt.zero_grad()
        loss = crit(model(*args, **kwargs), y)
        loss.backward()
        opt.step()
    return loss.item()


def _train(out_dir, eps: float, corrupt_at: int | None = None) -> NonFiniteError:
    """The rare-tokens loop (tokens 8-15 absent until step 5) with a learned temperature in
    its loss, both trained by one Adam."""
    torch.manual_seed(0)
    model, crit = I.make_token_classifier(), O.LearnedTemperatureCE()
    opt = torch.optim.Adam([*model.parameters(), *crit.parameters()], lr=1e-2, eps=eps)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2,
                            factory="infinity_models:make_token_classifier"):
            for s in range(8):
                x, y = _rare_batch(s)
                if s == corrupt_at:  # a bad resume of the loss's state between two steps
                    with torch.no_grad():
                        crit.log_scale.fill_(float("nan"))
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def _rare_tokens_loss(steps: int) -> float:
    """The loss at the last of ``steps`` steps of that loop with Adam(eps=1e-8)."""
    torch.manual_seed(0)
    model, crit = I.make_token_classifier(), O.LearnedTemperatureCE()
    opt = torch.optim.Adam([*model.parameters(), *crit.parameters()], lr=1e-2, eps=1e-8)
    for s in range(steps):
        x, y = _rare_batch(s)
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def test_a_what_if_updates_the_loss_s_trained_temperature_as_training_did(out_dir):
    """The bundle holds the temperature as a parameter, and ``--try eps=1e-8`` re-runs the
    window updating it too: its loss is that of training with eps=1e-8, which a replay that
    left the temperature as the bundle's end found it would miss."""
    err = _late_input(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (5, "optimizer", ["aux.weight"])
    meta, tensors = read_bundle(err.bundle_path)
    assert "<loss>.log_scale" in meta["params"] and "weights/<loss>.log_scale" in tensors
    rep = nanreplay(err.bundle_path, "eps=1e-8")
    assert (rep["cause"], rep["origin"]["param"]) == ("optimizer", "aux.weight"), rep["origin"]
    tried = what_if(rep)["eps=1e-8"]
    assert tried["finite"], tried
    last = tried["steps"][1]
    assert tried["loss"] == pytest.approx(_late_input_loss(last + 1, True), rel=1e-5)
    assert tried["loss"] != pytest.approx(_late_input_loss(last + 1, False), rel=1e-4)


def test_a_nan_written_into_the_loss_s_parameter_between_steps_is_named(out_dir):
    """A NaN temperature loaded between steps 2 and 3: a weights event naming the loss's
    parameter, whose last update had left it finite. The window, re-run from the copy at
    step 0 with the temperature as it was there and updated as training did, stays finite
    through step 3, as training with no NaN loaded does."""
    err = _train(out_dir, eps=1e-8, corrupt_at=3)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (3, "weights", ["<loss>.log_scale"])
    rep = nanreplay(err.bundle_path)
    assert (rep["cause"], rep["origin"]["param"]) == ("weights", "<loss>.log_scale"), rep
    assert any("<loss>.log_scale was first seen non-finite at step 3; the last update (step 2) "
               "left it finite" in p for p in rep["problems"]), rep["problems"]
    w = rep["window"]
    assert (w["steps"], w["reproduced"], w["first_non_finite"]) == ([0, 3], False, None), w
    assert w["per_step"][-1]["loss"] == pytest.approx(_rare_tokens_loss(4), rel=1e-5)
