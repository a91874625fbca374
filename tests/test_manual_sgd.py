"""End to end: training with no ``torch.optim``, as research scripts write it (an update by
hand after ``loss.backward()``, gradients from ``torch.autograd.grad``, ``backward(inputs=...)``
over alternating halves, an evaluation under ``torch.set_grad_enabled(False)``), recorded with
no optimizer and replayed."""

from __future__ import annotations

import logging

import manual_sgd_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.precursors import INPUT_JUMP

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS, LR = 6, 0.05


def train(model, style: str, rec=None, lr_at: dict[int, float] | None = None,
          blank: tuple[int, int] | None = None, end_step: bool = False,
          scale_at: dict[int, float] | None = None) -> list[float]:
    """The loop; ``lr_at``: the learning rate of some steps (a schedule's bug); ``blank``:
    (step, row) of a record of zeros; ``scale_at``: a factor on some steps' batches (a wrong
    unit); ``end_step``: ``rec.end_step()`` after ``torch.autograd.grad``."""
    crit = nn.MSELoss()
    losses = []
    step_of, row = blank if blank else (None, 0)
    for step, (x, y) in enumerate(M.batches(STEPS, step_of, row)):
        lr = (lr_at or {}).get(step, LR)
        x = x * (scale_at or {}).get(step, 1.0)
        loss = crit(model(x), y)
        if style == "autograd":
            params = list(model.parameters())
            grads = torch.autograd.grad(loss, params)
            if rec is not None and end_step:
                rec.end_step()
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= lr * g
        else:
            half = model.fc1 if step % 2 else model.fc2
            loss.backward(inputs=list(half.parameters()) if style == "halves" else None)
            M.sgd_by_hand(model, lr, "data" if style == "data" else "sub")
        with torch.set_grad_enabled(False):  # (a validation forward between the steps)
            model(x[:2])
        losses.append(loss.item())
    return losses


def recorded(make, style: str, out_dir, **kw) -> NonFiniteError:
    torch.manual_seed(0)
    model = getattr(M, make)()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, loss_fn=nn.MSELoss(), out_dir=out_dir,
                            factory=f"manual_sgd_models:{make}") as rec:
            train(model, style, rec, **kw)
    return info.value


@pytest.mark.parametrize("style", ["sub", "data", "autograd", "halves"])
def test_hand_updates_train_bit_identically_and_say_nothing(out_dir, style, caplog):
    """Each way of updating by hand, with the recorder given no optimizer: the same losses to
    the bit as without it, and no event nor warning."""
    torch.manual_seed(0)
    plain = train(M.make_regressor(), style)
    torch.manual_seed(0)
    model = M.make_regressor()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with FlightRecorder(model, loss_fn=nn.MSELoss(), out_dir=out_dir,
                            factory="manual_sgd_models:make_regressor") as rec:
            got = train(model, style, rec)
    assert got == plain
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert not list(out_dir.glob("*.nan"))


def test_a_learning_rate_jump_by_hand_is_the_updates_not_the_datas(out_dir):
    """A schedule's typo sets lr to 1e38 at step K: the loop's own update leaves the weights
    finite but huge, and the next step's loss overflows. With no optimizer no weight norm was
    measured, so every layer's absmax jumping from the first one read as the input batch's,
    and the hint said the data fed to that step was out of scale; the weights are now
    compared with the factory's model and the update before the step is named."""
    k = 3
    err = recorded("make_regressor", "sub", out_dir, lr_at={k: 1e38})
    assert err.event["step"] == k + 1
    report = nanreplay_json(err.bundle_path)
    assert report["cause"] == "overflow"
    assert {(p["step"], p["kind"]) for p in report["precursors"]} >= {(k + 1, "weight_jump")}
    assert not any(p["detail"].startswith(INPUT_JUMP) for p in report["precursors"])
    assert "out of scale" not in report["hint"]
    assert f"the weights had jumped in the update before step {k + 1}" in report["hint"]
    assert "lower the learning rate of the loop's own update" in report["hint"]


def test_a_batch_out_of_scale_under_a_hand_update_is_still_the_datas(out_dir):
    """The contrast: step K's batch in a unit 1e30x too large overflows that very step's loss
    while the weights are where the factory's are: the data is named, not the update."""
    k = 3
    err = recorded("make_linear_regressor", "sub", out_dir, scale_at={k: 1e30})
    assert err.event["step"] == k
    report = nanreplay_json(err.bundle_path)
    assert report["cause"] == "overflow"
    assert "But the data fed to this step is out of scale" in report["hint"]
    assert not any(p["kind"] == "weight_jump" for p in report["precursors"])


def test_a_learning_rate_that_makes_the_weights_infinite_blames_that_update(out_dir):
    """lr 1e39 at step K (beyond float32): the hand update writes +-inf weights, seen as the
    next step begins. The update is the loop's optimizer: cause ``optimizer``, as with
    torch.optim.SGD, and the hint names the update after step K."""
    k = 2
    err = recorded("make_regressor", "sub", out_dir, lr_at={k: 1e39})
    assert (err.event["step"], err.event["phase"]) == (k + 1, "weights")
    report = nanreplay_json(err.bundle_path)
    assert report["cause"] == "optimizer"
    assert f"the loop's own update after step {k} (p -= lr * p.grad) wrote them from finite " \
        "gradients" in report["hint"]


@pytest.mark.parametrize("make, phase, op", [
    ("make_log_regressor", "forward", "aten.log"),
    ("make_norm_regressor", "backward", "SqrtBackward0"),
])
def test_a_blank_record_under_a_hand_update_is_named(out_dir, make, phase, op):
    """Record ROW of step K all zeros: log(0) in the forward, or the backward of a norm's sqrt
    at 0; the step closes before the hand update, so the replay re-runs it."""
    k, row = 2, 5
    err = recorded(make, "data", out_dir, blank=(k, row))
    assert (err.event["step"], err.event["phase"]) == (k, phase)
    report = nanreplay_json(err.bundle_path)
    assert report["reproduced"] and report["cause"] == "invalid"
    assert (report["origin"]["op"], report["origin"]["samples"]) == (op, [row])


@pytest.mark.parametrize("end_step", [True, False])
def test_a_backward_trap_under_autograd_grad_is_named_at_its_step(out_dir, end_step):
    """torch.autograd.grad writes no .grad, yet the recorder sees its gradients as they pass
    and closes the step as it returns (before rec.end_step(), if the loop calls it, and before
    the hand update): the sqrt(0) of step K's blank record in the root's norm penalty is a
    backward event at step K, SqrtBackward0 on that record, not K + 1's weights."""
    k, row = 2, 5
    err = recorded("make_norm_regressor", "autograd", out_dir, blank=(k, row), end_step=end_step)
    assert (err.event["step"], err.event["phase"]) == (k, "backward")
    report = nanreplay_json(err.bundle_path)
    assert report["reproduced"] and report["cause"] == "invalid"
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["samples"]) == ("SqrtBackward0", "", [row])
