"""End to end on losses that take forward-mode derivatives (``forward_mode_models``): a
MeanFlow loss by ``torch.func.jvp`` (the model under the jvp only, or the jvp inside a
``loss_fn`` given the model), a Jacobian-vector penalty by ``torch.autograd.forward_ad``, and
DP-SGD by ``vmap(grad(...))`` over ``functional_call`` with a hand-written clip; each run
under the recorder until a planted bug fires, then replayed."""

from __future__ import annotations

import forward_mode_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

import replay
from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "forward_mode_models:"
AT, FLOW_ROW, DUAL_ROW, PAD_ROW = 3, 3, 5, 2  # the planted step, and its record per shape


def line_of(text: str) -> str:
    return source_line("forward_mode_models.py", text)


def flow_run(tmp_path, at=None, recorded=True):
    """MeanFlow with the jvp in ``loss_fn`` (given the plain forward's output and the model)."""
    model = M.make_flownet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []

    def loop(loss_fn):
        for x, noise, t in M.flow_batches(5, zero_t_at=at, row=FLOW_ROW):
            opt.zero_grad()
            z = (1 - t[:, None]) * x + t[:, None] * noise
            loss = loss_fn(model(z, t), model, x, noise, t)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not recorded:
        loop(M.meanflow_terms)
        return losses
    with FlightRecorder(model, opt, loss_fn=M.meanflow_terms, out_dir=tmp_path,
                        factory=FACTORY + "make_flownet") as rec:
        loop(rec.loss_fn)
    assert rec.health.internal_errors == 0
    return losses


def dual_run(tmp_path, at=None, recorded=True, as_loss_fn=True):
    """The forward_ad penalty: in ``loss_fn`` given the model, or added in the loop."""
    model = M.make_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []

    def loop(loss_fn):
        for x, y, v in M.regression_batches(5, zero_v_at=at, row=DUAL_ROW):
            opt.zero_grad()
            loss = (loss_fn(model(x), y, model, x, v) if as_loss_fn
                    else F.mse_loss(model(x), y) + 0.1 * M.jvp_penalty(model, x, v))
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not recorded:
        loop(M.smooth_loss)
        return losses
    with FlightRecorder(model, opt, loss_fn=M.smooth_loss if as_loss_fn else None,
                        out_dir=tmp_path, factory=FACTORY + "make_regressor") as rec:
        loop(rec.loss_fn if as_loss_fn else None)
    return losses


def test_healthy_forward_mode_losses_train_bit_identically_and_raise_nothing(tmp_path):
    """The jvp and the dual-tensor forward under the recorder's hooks change nothing."""
    assert flow_run(tmp_path) == flow_run(tmp_path, recorded=False)
    assert dual_run(tmp_path) == dual_run(tmp_path, recorded=False)
    assert not list(tmp_path.glob("*.nan"))


def test_meanflow_jvp_of_sqrt_time_at_zero_names_the_tangents_pole(tmp_path):
    """t = 0 for one record: sqrt's slope 1/(2 sqrt t) is 1/0 in the jvp's tangent, the
    target NaN; a loss event of that step, the division on the sqrt's line, that record."""
    with pytest.raises(NonFiniteError) as info:
        flow_run(tmp_path, at=AT)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (AT, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["made"], o["samples"]) == (
        "invalid", "aten.div", "+inf", [FLOW_ROW]), rep
    assert o["source"] == line_of("temb = self.embed(torch.sqrt(t)[:, None])")


def test_forward_ad_penalty_in_loss_fn_names_the_zero_direction(tmp_path):
    """``||J v|| / ||v||`` through make_dual/unpack_dual, v masked to 0 for one record: 0/0
    in the loss, named in the replay (from Python) with its line and record."""
    with pytest.raises(NonFiniteError) as info:
        dual_run(tmp_path, at=AT)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (AT, "loss")
    rep = replay.replay(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", "nan", [DUAL_ROW]), rep
    assert o["source"] == line_of("return (jv.norm(dim=-1) / v.norm(dim=-1)).mean()")


def test_forward_ad_penalty_added_in_the_loop_points_at_the_tangent_term(tmp_path):
    """The same penalty added to the loss in the loop, no loss_fn: the NaN reaches the weights
    through the tangent, around the dual call's output, which took no gradient. The hint said
    the loop wrote the gradients itself (per-sample gradients, a clip); it now names the
    forward whose output took none and the jvp term to move into loss_fn."""
    with pytest.raises(NonFiniteError) as info:
        dual_run(tmp_path, at=AT, as_loss_fn=False)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (AT, "backward")
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    # the dual call is the step's second forward: micro-batch 1
    assert rep["hint"].startswith("micro-batch 1 of this step ran the model with gradients on "
                                  "but no gradient reached its output"), rep["hint"]
    assert "forward_ad" in rep["hint"] and "loss_fn(out, y, model" in rep["hint"]


def test_dp_sgd_clip_of_a_padding_record_is_caught_at_its_step_before_the_update(tmp_path):
    """DP-SGD whose only plain forward is the logged loss under no_grad; the padding record of
    step AT has a zero gradient, its clip 0/0 makes every clipped mean NaN. Its forwards ran
    under vmap only, unrecorded: the update is a step of its own, so the NaN gradients are
    caught at step AT before SGD applies them (it was found a step late, at the next forward,
    as an update of step 0, with the advice to lower the learning rate), and the hint names
    the transforms and the per-sample clip."""
    model = M.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_classifier"):
            for x, y, keep in M.class_batches(6, pad_at=AT, row=PAD_ROW):
                with torch.no_grad():
                    F.cross_entropy(model(x), y)  # the loss logged
                M.dp_sgd_step(model, opt, x, y, keep)
    err = info.value
    names = [n for n, _ in model.named_parameters()]
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (AT, "backward", names)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # (the update never ran)
    rep = replay.replay(err.bundle_path)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    hint = rep["hint"]
    assert hint.startswith(f"the gradients the update was about to use ({', '.join(names)}) "
                           "came from forwards of the model under torch.func transforms"), hint
    assert "a division by a per-sample norm that is 0" in hint, hint
    assert any("only under torch.func transforms" in p for p in rep["problems"]), rep


def test_meanflow_under_the_jvp_only_is_caught_at_its_step_and_names_the_transform(tmp_path):
    """The model called only under torch.func.jvp: nothing of its forward is recorded, but the
    update is a step of its own, so the tangent's NaN gradients are caught at step AT (they
    were found only as the recorder detached, as an optimizer event), and the hint names the
    jvp and the sqrt at 0 instead of "the loop's own code"."""
    model = M.make_flownet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_flownet"):
            for x, noise, t in M.flow_batches(AT + 1, zero_t_at=AT, row=FLOW_ROW):
                opt.zero_grad()
                M.meanflow_loss(model, x, noise, t).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (AT, "backward")
    rep = replay.replay(err.bundle_path)
    assert (rep["reproduced"], rep["cause"]) == (False, "not_reproduced"), rep
    assert "under torch.func transforms (jvp, vmap, grad)" in rep["hint"], rep["hint"]
    assert "not by backward through the model" not in rep["hint"], rep["hint"]
