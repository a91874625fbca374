"""The ``torch.optim`` zoo as training scripts use it (Adafactor, AdamW with a tensor learning
rate, LambdaLR schedules, parameter groups without weight decay on norms and biases), each
trained until its update goes non-finite, then replayed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zf_models as ZF
from bundles import nanreplay_json
from ci import requires_cuda
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, make_opt, make_sched=None, epochs: int = 2, batch_size: int = 32,
           dead: int | None = None, **kw) -> NonFiniteError:
    """A classifier's epochs over a shuffled DataLoader, the scheduler stepped per batch."""
    model = ZF.make_model()
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched is not None else None
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="zf_models:make_model", **kw):
            for _ in range(epochs):
                for x, y in ZF.loader(batch_size=batch_size, dead=dead):
                    opt.zero_grad()
                    crit(model(x), y).backward()
                    opt.step()
                    if sched is not None:
                        sched.step()
    return info.value


SQUARED = "eps1=1e-30 squared is 0 in float32"


@pytest.mark.parametrize("kw", [{}, {"guard_optimizer": True}], ids=["after-update", "guard"])
def test_adafactor_with_hugging_faces_eps_names_eps1_squared(out_dir, kw):
    """Hugging Face's Adafactor spelling eps=(1e-30, 1e-3) given to torch.optim.Adafactor,
    which floors its factored second moment at eps1 * eps1 (1e-60: 0 in float32), and a
    one-hot column that no record has: its column of embed.weight gets gradients of exactly 0,
    rsqrt(0) = inf, inf * 0 = NaN at the first update. The hint was LAMB's trust ratio
    ('add an eps to the denominator ... LAMB and LARS'), or for a bundle written after the
    update 'check the learning rate and schedule'; --try eps=1e-8 raised TypeError in the
    optimizer (it unpacks two eps) and --try auto proposed no eps."""
    err = _train(out_dir, lambda m: torch.optim.Adafactor(ZF.param_groups(m), lr=1e-2,
                                                          eps=(1e-30, 1e-3)), dead=5, **kw)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", ["embed.weight"])
    if not kw:
        rep = nanreplay_json(err.bundle_path, code=1)
        assert rep["cause"] == "optimizer" and SQUARED in rep["hint"], rep["hint"]
        return
    rep = nanreplay_json(err.bundle_path, "--try", "eps=1e-8", "--try", "auto")
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    assert (rep["origin"]["param"], rep["origin"]["op"]) == ("embed.weight", "aten.rsqrt_")
    assert SQUARED in rep["hint"] and "eps=(None, 1e-3)" in rep["hint"], rep["hint"]
    assert "LAMB" not in rep["hint"]
    tries = {t["try"]: t for t in rep["what_if"]}
    assert tries["eps=1e-8"]["finite"] is True, tries
    assert tries["eps=1.2e-07"]["finite"] is True, tries  # (torch's default eps1, from auto)
    assert tries["lr=0.1x"]["finite"] is False


def test_a_window_re_runs_past_an_optimizer_state_that_overflowed(out_dir):
    """A step decay written as a LambdaLR with its exponent's sign flipped (0.1 ** -(s // 2):
    the rate grows 10x every two steps): AdamW's exp_avg_sq of norm.weight overflowed to +inf
    a step before the backward event, its weights still finite. Training's check reads the
    weights, so it trained on to a backward event at step 18. The state is now checked
    after an update whose step's norms overflowed: the update of step 17 is the event, its
    hint names the state, the gradient whose square overflowed and the rate's growth."""
    err = _train(out_dir, lambda m: torch.optim.AdamW(ZF.param_groups(m), lr=1e-3),
                 lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.1 ** -(s // 2)),
                 epochs=5, batch_size=64, rewind=4)
    # (the state's +inf is the event now, at its update: recorder.state_check)
    assert (err.event["step"], err.event["phase"]) == (17, "optimizer"), err.event
    assert "exp_avg_sq" in err.event["state"]["norm.weight"], err.event["state"]
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["cause"] == "overflow" and "exp_avg_sq of norm.weight" in rep["hint"], rep
    # (the rewind window holds step 17's batch: it re-runs the update, checking the state
    # as training did, and says where the rates grew)
    assert rep["window"]["reproduced"] and rep["not_rerun"] is None, rep["window"]
    assert "the learning rate (parameter group 0) 1e+04 is 10x the median" in rep["hint"]
    assert not any("no batch of that step" in p for p in rep["problems"]), rep["problems"]
    first = rep["window"]["first_non_finite"]
    assert (first["step"], first["params"], first["state"]) == (17, ["norm.weight"], "exp_avg_sq")


def test_an_inf_warm_up_rate_at_step_0_proposes_the_scheduler_s_initial_rate(out_dir):
    """An inverse-square-root decay computed with NumPy, (4 / s) ** 0.5, over a tensor
    learning rate (as compiled and capturable optimizers take it): at step 0 it is inf. Recorded
    with guard_optimizer, --try auto proposed nothing (the history had no finite rate yet);
    now it tries the rate the scheduler started from, each group's initial_lr."""
    def warm_up(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (4 / np.float64(s)) ** 0.5)

    with np.errstate(divide="ignore"):
        err = _train(out_dir, lambda m: torch.optim.AdamW(ZF.param_groups(m, head_lr=3e-3),
                                                          lr=torch.tensor(3e-4)),
                     warm_up, guard_optimizer=True)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    assert rep["reproduced"] and "its lr was inf in that update" in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("lr=0.003", True)]


def test_gradient_ascent_on_a_loss_names_maximize(out_dir):
    """SGD with maximize=True (kept from a script that maximised a log-likelihood) over a
    cross-entropy loss: every update climbs the loss until a forward overflows. The hint said
    to rescale the op or lower the learning rate, never the flag; it now names
    maximize=True and the loss's climb."""
    err = _train(out_dir, lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9,
                                                    maximize=True), epochs=3)
    assert err.event["phase"] == "forward"
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "overflow"
    assert "The optimizer has maximize=True, so every update climbs what the loss returns, " \
        "and it rose from 1.12 at step 0" in rep["hint"], rep["hint"]
    assert "drop maximize=True" in rep["hint"]


@requires_cuda
def test_a_cuda_tensor_learning_rate_is_not_read_as_nan(out_dir):
    """A learning rate kept as a CUDA tensor (a fused AdamW, as torch.compile'd optimizer steps
    take it) and eps=0 over a one-hot column no record has. The ring recorded such a rate as
    NaN (it reads no device value per step), and the replay read that NaN as the update's
    rate: 'its lr was nan in that update ... fix that value' instead of the eps=0 0/0."""
    model = ZF.make_model().cuda()
    opt = torch.optim.AdamW(ZF.param_groups(model), lr=torch.tensor(1e-3, device="cuda"),
                            eps=0.0, fused=True)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="zf_models:make_model", guard_optimizer=True):
            for x, y in ZF.loader(dead=5):
                opt.zero_grad()
                crit(model(x.cuda()), y.cuda()).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "optimizer" and rep["origin"]["param"] == "embed.weight"
    assert "with eps=0" in rep["hint"] and "lr was" not in rep["hint"], rep["hint"]
