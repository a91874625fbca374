"""Who wrote the non-finite weights, and when (issue 11, item 2).

Right after every update the recorder takes each weight's squared norm on the device (the
optimizer's step post-hook) and checks it with the next step's single host read. So:

- an update that turns finite gradients into NaN weights (``Adam(eps=0)`` on a gradient of
  exactly 0: 0/0) is an ``optimizer`` event at that update's step;
- a weight made non-finite outside ``optimizer.step()`` between two steps (an in-place edit, a
  bad ``load_state_dict``) is a ``weights`` event naming the parameter and the step where it
  was first seen, noting that the last update left it finite;
- an update that writes NaN into embedding rows not read until much later is the event at that
  update (step 0, ``emb.weight``), not at the step whose batch first reads them.

Bundles are replayed with ``nanreplay BUNDLE --json``.
"""

from __future__ import annotations

import math

import infinity_models as I
import pytest
import torch
from bundles import nanreplay_json
from click.testing import CliRunner
from models import check_event
from test_recorder_sync import FLIGHT, count_host_reads
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.cli import main as cli

K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def dead_feature_batch(step: int):
    """Feature 3 is always 0 (a constant column the pipeline zeroed): its weights' gradient is
    exactly 0 at every step."""
    x, y = I.batch(step)
    x[:, 3] = 0.0
    return x, y


def _train(factory, make_batch, out_dir, *, opt_fn, steps=6, at=None, loss_fn=None,
           **rec_kwargs):
    model = getattr(I, factory)()
    opt = opt_fn(model.parameters())
    crit = loss_fn or nn.CrossEntropyLoss()
    ran = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"infinity_models:{factory}", **rec_kwargs):
            for step in range(steps):
                if at is not None:
                    at(step, model)
                x, y = make_batch(step)
                ran.append(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value, model, ran


def adam_eps0(params):
    return torch.optim.Adam(params, lr=1e-2, eps=0.0)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


# ---------------------------------------------------------------------------------------------
# the update wrote them


def test_update_turning_finite_gradients_into_nan_weights_is_the_optimizer(out_dir):
    err, model, ran = _train("make_linear", dead_feature_batch, out_dir, opt_fn=adam_eps0)
    # Adam's first update of a weight whose gradient is exactly 0: m / (sqrt(v) + eps) = 0/0
    check_event(err.event, step=0, phase="optimizer", params=["weight"], kind="nan",
                after_update=True)
    assert ran == [0, 1]  # seen with step 1's one read: before step 1's own update
    assert torch.isnan(model.weight[:, 3]).all() and torch.isfinite(model.weight[:, :3]).all()
    meta, t = read_bundle(err.bundle_path)
    assert meta["state"] == "after_update"
    assert torch.isfinite(t["ring/grad_norms"][0]).all()  # step 0's gradients were finite
    rep = nanreplay_json(err.bundle_path, code=1)
    assert rep["cause"] == "optimizer" and rep["event"]["step"] == 0
    assert (rep["origin"]["phase"], rep["origin"]["params"]) == ("optimizer", ["weight"])


def test_an_update_event_stays_the_optimizer_when_the_next_batch_is_non_finite_too(out_dir):
    """The update of step 0 writes NaN; the batch of step 1, whose read finds it, is NaN too
    (a GAN's fakes from a generator the same kind of update broke, which the recorder does not
    watch). The bundle's batch came after the update: the origin stays the optimizer's."""
    def make(step):
        x, y = dead_feature_batch(step)
        if step == 1:
            x[2] = math.nan
        return x, y

    err, _, ran = _train("make_linear", make, out_dir, opt_fn=adam_eps0)
    check_event(err.event, step=0, phase="optimizer", params=["weight"], kind="nan",
                after_update=True)
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["params"]) == \
        ("optimizer", "optimizer", ["weight"]), rep["origin"]


def test_embedding_rows_written_nan_long_before_they_are_read(out_dir):
    """Tokens 8-15 are absent until step 5: Adam(eps=0) makes their rows 0/0 at step 0."""
    def make(step):
        idx, _ = I.token_batch(step)
        idx = idx % 8  # tokens 0-7 only...
        if step == 0:
            idx[0, :8] = torch.arange(8)  # (each of them at step 0)
        if step == 5:
            idx[2, 0] = 12  # ...until a rare token appears
        return idx, torch.arange(I.BATCH) % I.N_CLASSES

    err, model, ran = _train("make_token_classifier", make, out_dir, opt_fn=adam_eps0, steps=8)
    check_event(err.event, step=0, phase="optimizer", params=["emb.weight"], kind="nan",
                after_update=True)
    assert ran == [0, 1]  # not at step 5, when row 12 is first read
    w = model.emb.weight.detach()
    assert torch.isnan(w[8:]).all() and torch.isfinite(w[:8]).all()
    rep = nanreplay_json(err.bundle_path, code=1)
    assert rep["cause"] == "optimizer" and rep["event"]["step"] == 0
    assert rep["origin"]["params"] == ["emb.weight"]


def test_last_update_before_the_loop_ends_is_checked_at_exit(out_dir):
    model = I.make_linear()
    opt = adam_eps0(model.parameters())
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_linear"):
            x, y = dead_feature_batch(0)
            crit(model(x), y).backward()
            opt.step()  # the last step: no next step reads its evidence
    check_event(info.value.event, step=0, phase="optimizer", params=["weight"],
                after_update=True)


@pytest.mark.parametrize("replace", [
    lambda w: w.detach().clone(),  # a checkpoint loaded by assignment: new storage
    lambda w: w.detach().t().contiguous().t(),  # the same values in a transposed layout
])
def test_an_update_of_weights_given_new_storage_is_seen_there(out_dir, replace):
    """``p.data = ...`` between steps moves a weight to new storage: the evidence after the
    next update reads that storage (an update that makes it NaN is the optimizer's, at that
    step), not the memory the weight left."""
    model = I.make_mlp()
    w = model[2].weight
    opt = torch.optim.SGD([{"params": [w]},
                           {"params": [p for p in model.parameters() if p is not w]}], lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="infinity_models:make_mlp"):
            for step in range(6):
                if step == K:
                    w.data = replace(w)
                    opt.param_groups[0]["lr"] = math.nan  # this update writes NaN into w
                x, y = I.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    check_event(info.value.event, step=K, phase="optimizer", params=["2.weight"], kind="nan",
                after_update=True)


# ---------------------------------------------------------------------------------------------
# written outside optimizer.step()


def _edit_in_place(step, model):
    if step == K:
        with torch.no_grad():
            model[2].weight[1, 5] = float("nan")  # an in-place edit between two steps


def _bad_load(step, model):
    if step == K:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["2.weight"][0, 0] = math.inf  # a checkpoint that holds an Inf
        model.load_state_dict(state)


@pytest.mark.parametrize("at, kind", [(_edit_in_place, "nan"), (_bad_load, "+inf")])
def test_weight_written_outside_the_optimizer_is_weights(out_dir, at, kind):
    err, _, ran = _train("make_mlp", I.batch, out_dir, opt_fn=sgd, at=at)
    check_event(err.event, step=K, phase="weights", params=["2.weight"], kind=kind,
                first_seen_step=K, last_update_step=K - 1)
    assert ran[-1] == K
    assert "left them finite" in str(err) or "left them finite" in err.event["detail"]
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "weights"
    o = rep["origin"]
    assert (o["phase"], o["params"], o["first_seen_step"], o["last_update_step"]) == \
        ("weights", ["2.weight"], K, K - 1)
    assert any(f"the last update (step {K - 1}) left it finite" in p for p in rep["problems"])
    res = CliRunner().invoke(cli, [str(err.bundle_path)])
    assert "written outside optimizer.step()" in res.output and "cause      weights" in res.output


def test_weights_bad_from_the_start_have_no_update_to_blame(out_dir):
    def at(step, model):
        if step == 0:
            with torch.no_grad():
                model[0].bias[2] = float("nan")  # loaded that way, before any update

    err, _, _ = _train("make_mlp", I.batch, out_dir, opt_fn=sgd, at=at)
    check_event(err.event, step=0, phase="weights", params=["0.bias"], first_seen_step=0)
    assert "last_update_step" not in err.event


# ---------------------------------------------------------------------------------------------
# the evidence itself: in the ring, within the one read per step


def test_update_norms_are_in_the_ring_and_cost_no_read(out_dir):
    model = I.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    crit = nn.CrossEntropyLoss()
    after = []
    reads = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        with count_host_reads() as calls:
            for step in range(4):
                seen = len(calls)
                x, y = I.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                reads.append([c for c in calls[seen:] if c[1] == FLIGHT])
                after.append([p.detach().norm().item() for p in model.parameters()])
        _, ring = rec.cycle.ring.export(len(rec.target.params), 1)
    assert [len(r) for r in reads] == [1] * 4
    norms = ring["ring/update_norms"]
    assert torch.isnan(norms[0]).all()  # step 0 follows no update
    for step in range(1, 4):  # step k's row holds the norms right after update k - 1
        assert norms[step].tolist() == pytest.approx(after[step - 1], rel=1e-5)


def test_an_update_that_writes_nan_into_a_channels_last_conv_weight_is_the_optimizer(out_dir):
    """A channels-last convolution's weight is read for the evidence through a view of its
    memory (``recorder.slots.flat_view``): Adam(eps=0) on an input channel the pipeline zeroed
    writes 0/0 into that channel's filters at the first update, and that update is the event."""
    import replay_models as R

    model = R.make_channels_last_conv_net()
    opt = adam_eps0(model.parameters())
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="replay_models:make_channels_last_conv_net"):
            for step in range(4):
                x, y = R.image_batch(step)
                x[:, 0] = 0.0  # a dead input channel: its filters' gradient is exactly 0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    check_event(info.value.event, step=0, phase="optimizer", params=["conv.weight"], kind="nan",
                after_update=True)
    w = model.conv.weight.detach()
    assert torch.isnan(w[:, 0]).all() and torch.isfinite(w[:, 1:]).all()
