"""Two FlightRecorders on one model at once, the inner in the outer's open ``with`` block.

Before, the inner one took the model over (detaching the outer with the notebook warning);
when it ended, the rest of the outer block ran unrecorded (a NaN there was never caught) and
the outer's exit said it "saw no forward" and blamed a model built again. Now the inner one
is refused in one line before it registers anything, and the outer records on. The recorder's
own ``with`` block inside its block, and a recorder attached again after epochs unrecorded,
record on as the outer block and the new epochs need."""

from __future__ import annotations

import models as M
import pytest
import torch
from models import bundles, check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError

NAN_STEP = 3  # the plant: a NaN in this step's batch, after the refused inner recorder


def _nan_at(k):
    def make(step):
        x, y = M.batch(step)
        if step == k:
            x[1, 0] = float("nan")
        return x, y
    return make


def _hooks(model, opt):
    return (sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
            len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks))


def test_a_nested_recorder_of_the_same_model_is_refused_and_the_outer_records_on(tmp_path):
    torch.manual_seed(0)
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as raised:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "outer") as outer:
            M.train(model, opt, crit, 2)
            one = _hooks(model, opt)
            with pytest.raises(ValueError) as info:
                with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "inner",
                                    guard_optimizer=True):
                    pytest.fail("the inner block ran")
            assert _hooks(model, opt) == one  # (nothing of the inner one registered)
            M.train(model, opt, crit, NAN_STEP + 2, make_batch=lambda s: _nan_at(NAN_STEP)(s + 2))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(
        "FlightRecorder: Sequential is already recorded by a FlightRecorder whose `with` block "
        "is still open"), msg
    check_event(raised.value.event, step=NAN_STEP, phase="input")
    assert outer.event["step"] == NAN_STEP
    assert raised.value.bundle_path.parent == tmp_path / "outer"
    assert bundles(tmp_path / "inner") == []
    assert _hooks(model, opt) == (0, 0)


def test_after_the_block_ends_another_recorder_attaches(tmp_path):
    """The refusal lasts as long as the outer block: after it (cleanly, or by its event) a
    new ``with`` and a bare ``attach()`` record as usual, with no warning."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "a"):
        M.train(model, opt, crit, 1)
    with pytest.raises(NonFiniteError):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b"):
            M.train(model, opt, crit, 2, make_batch=_nan_at(0))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "c").attach()
    with pytest.raises(NonFiniteError) as info:
        M.train(model, opt, crit, 3, make_batch=_nan_at(1))
    check_event(info.value.event, step=1, phase="input")
    assert rec.bundle_path.parent == tmp_path / "c"


def test_the_recorders_own_block_inside_its_block_leaves_it_recording(tmp_path):
    """``with rec:`` again inside ``with rec:`` (a helper that enters the recorder it is
    given). Before, the inner block's end detached it: the rest of the outer block ran
    unrecorded and the NaN of step 3 was never caught."""
    torch.manual_seed(0)
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path)
    with pytest.raises(NonFiniteError) as raised:
        with rec:
            with rec:
                M.train(model, opt, crit, 2)
            assert rec.step == 2 and _hooks(model, opt) != (0, 0)
            M.train(model, opt, crit, NAN_STEP, make_batch=lambda s: _nan_at(NAN_STEP)(s + 2))
    check_event(raised.value.event, step=NAN_STEP, phase="input", samples=[1])
    assert _hooks(model, opt) == (0, 0)


def test_weights_written_while_detached_are_a_weights_event_when_attached_again(tmp_path):
    """Recording only some epochs: the weights went NaN while the recorder was detached.
    Before, attached again it still held that an update had run since its last step, and
    named that finite update: 'step 1, phase optimizer'."""
    torch.manual_seed(0)
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path)
    with rec:
        M.train(model, opt, crit, 2)
    M.train(model, opt, crit, 2)  # (an epoch not recorded)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as raised:
        with rec:
            M.train(model, opt, crit, 1)
    check_event(raised.value.event, step=2, phase="weights", params=["2.weight"])
