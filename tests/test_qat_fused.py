"""Quantization-aware training the way PyTorch's QAT tutorial writes it: conv-bn-relu and
linear-relu fused with ``fuse_modules_qat``, x86's default QAT qconfig, ``prepare_qat``, the
observers disabled and the BatchNorm statistics frozen mid-run. Fake quantization rounds a NaN
to a number, and the fused conv-bn reads ``bn.running_var`` in training, so a bad record can
surface a step later, in another module, or nowhere."""

from __future__ import annotations

import json

import pytest
import qat_models as Q
import torch
import torch.ao.quantization as tq
from bundles import invoke_cli
from torch.ao.nn.intrinsic import qat as nniqat

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = [pytest.mark.filterwarnings(
    "ignore:torch.ao.quantization is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning")]

OBSERVERS_OFF, BN_FROZEN, STEPS, ROW = 4, 5, 7, 3


def _run(out_dir, plant=None, record: bool = True, maker=Q.make_fused, positive=False):
    """The tutorial's loop; ``plant(step, x)`` writes the bug into a batch. The losses and
    the model's state (the fake-quant scales, zero points, observer min/max) after it."""
    torch.manual_seed(0)
    model = maker()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    losses = []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"qat_models:{maker.__name__}") if record else None
    with rec if rec is not None else torch.enable_grad():
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if positive:
                x = x.abs() + 0.5
            if plant is not None:
                plant(step, x)
            if step == OBSERVERS_OFF:
                model.apply(tq.disable_observer)
            if step == BN_FROZEN:
                model.apply(nniqat.freeze_bn_stats)
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_recording_a_fused_qat_run_changes_nothing_it_computes(out_dir):
    plain, plain_state = _run(out_dir, record=False)
    recorded, state = _run(out_dir)
    assert recorded == plain
    assert plain_state.keys() == state.keys()
    assert all(torch.equal(plain_state[k], state[k]) for k in state), \
        [k for k in state if not torch.equal(plain_state[k], state[k])]
    assert not list(out_dir.glob("*.nan"))


def test_an_outlier_that_overflows_the_fused_bn_statistic_is_that_steps_event(out_dir):
    """A record of 3e38 at step 2 overflows the fused conv-bn's ``bn.running_var`` to +inf while
    the batch statistics, the loss and the gradients stay finite. It was no event at that step
    (the next step's forward divided by the weight the statistic scaled to 0: 0/0 at step 3,
    where the float64 re-run refused the fake-quant kernels, cause 'unknown', and the hint asked
    for an eps); the running statistics are checked as each step closes now
    (recorder.running_stats): step 2, the batch norm's op, the record, an overflow."""
    at = 2

    def plant(step, x):
        if step == at:
            x[ROW, 0, 2, 2] = 3e38

    with pytest.raises(NonFiniteError) as info:
        _run(out_dir, plant)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"],
            err.event["statistic"]) == (at, "forward", "conv.bn", "conv.bn.running_var")
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert rep["reproduced"] and (o["module"], o["op"], o["samples"]) == \
        ("conv.bn", "aten.native_batch_norm", [ROW]), o
    assert rep["cause"] == "overflow", rep["cause"]  # (the float64 re-run ran the fake quants)
    assert f"--try drop={ROW}" in rep["hint"]


def test_a_statistic_overflowed_before_the_attach_is_named_at_the_fused_division(out_dir):
    """The same record at step 2 with the recorder attached at step 3: the statistic comes in
    +inf, and that step's forward scales the conv weight by ``bn.weight / sqrt(running_var)``,
    0, and divides by it: 0/0 in ``conv``, whose hint names the statistic, not an eps."""
    at = 2
    torch.manual_seed(0)
    model = Q.make_fused()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="qat_models:make_fused")
    with pytest.raises(NonFiniteError) as info:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            if step == at:
                x[ROW, 0, 2, 2] = 3e38
            if step == at + 1:
                rec.attach()
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "conv")
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert rep["reproduced"] and (o["module"], o["op"]) == ("conv", "aten.div"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "conv.bn.running_var held an infinity as the step began" in rep["hint"], rep["hint"]
    assert "eps to the denominator" not in rep["hint"]


def test_a_nan_record_after_the_observers_are_off_is_not_called_imputed(out_dir):
    """With the observers off, fake quantization rounds the NaN to the zero point: every
    output stays finite. The hint said to allow it with allow_nan, as missing values the
    model imputes."""
    at = OBSERVERS_OFF + 1

    def plant(step, x):
        if step == at:
            x[ROW, 0, 1, 1] = float("nan")

    with pytest.raises(NonFiniteError) as info:
        _run(out_dir, plant)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (at, "input", [ROW])
    rep = replay(err.bundle_path, factory=Q.make_fused)
    assert rep["reproduced"] and rep["cause"] == "input" and rep["origin"]["samples"] == [ROW]
    assert "fake-quantizes (quant.activation_post_process" in rep["hint"], rep["hint"]


def test_a_log_of_a_blank_record_before_the_quant_stub_is_the_root_s_log(out_dir):
    """log(0) = -inf taken in forward; the QuantStub's observer then makes the whole batch
    NaN. The replay (factory given from Python) names the log and that one sample."""
    at = 2

    def plant(step, x):
        if step == at:
            x[ROW] = 0.0

    with pytest.raises(NonFiniteError) as info:
        _run(out_dir, plant, maker=Q.make_fused_log, positive=True)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (at, "forward")
    rep = replay(err.bundle_path, factory=Q.make_fused_log)
    o = rep["origin"]
    assert rep["reproduced"] and (o["module"], o["op"], o["samples"]) == ("", "aten.log", [ROW])
    assert rep["cause"] == "invalid"
