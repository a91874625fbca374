"""Training-loop machinery recorded and replayed as users write it: learning-rate schedules
(``LambdaLR`` warm-ups computed with NumPy), several optimizers and parameter groups, scalers
and clipping."""

from __future__ import annotations

import machinery_models as MM
import numpy as np
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

LR_INF = "its lr was inf in that update"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _inverse_sqrt_warmup(out_dir, **kw) -> NonFiniteError:
    """An inverse-square-root schedule written with NumPy, ``(warmup / s) ** 0.5``: at step 0
    it divides by 0, and ``LambdaLR`` sets the rate to ``np.float64(inf)``."""
    model = MM.make_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info, np.errstate(divide="ignore"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (4 / np.float64(s)) ** 0.5)
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="machinery_models:make_classifier", **kw):
            for step in range(6):
                x, y = MM.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                sched.step()
    return info.value


@pytest.mark.parametrize("kw", [{"guard_optimizer": True}, {"rewind": 4}],
                         ids=["guard", "rewind"])
def test_a_numpy_inf_learning_rate_is_re_run_and_named(out_dir, kw):
    """The bundle spelt NumPy's non-finite float64 as 'np.float64(inf)' (its repr), which
    neither the optimizer re-run ('str' / float) nor the window (float('np.float64(inf)'))
    could read: the replay failed. Now it re-runs the update and names the rate."""
    err = _inverse_sqrt_warmup(out_dir, **kw)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path, "--try", "lr=1e-3")
    assert rep["reproduced"] and rep["cause"] == "optimizer", rep
    assert rep["origin"]["param"] == "fc1.weight"
    assert LR_INF in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_an_inf_learning_rate_is_named_from_the_ring_when_the_update_is_not_re_run(out_dir):
    """Recorded without a guard, the bundle holds the groups as the schedule left them for the
    next step (a finite rate); the rate of the update that broke the weights is the ring
    buffer's. The hint said only 'check the learning rate and schedule'."""
    err = _inverse_sqrt_warmup(out_dir)
    assert (err.event["step"], err.event["phase"], err.event["after_update"]) == \
        (0, "optimizer", True)
    rep = nanreplay_json(err.bundle_path, code=1)
    assert not rep["reproduced"] and rep["cause"] == "optimizer"
    assert rep["origin"]["param"] == "fc1.weight"
    assert LR_INF in rep["hint"], rep["hint"]


EPS0 = "with eps=0 an element whose gradients have all been exactly 0"


@pytest.mark.parametrize("opt_cls,kw,at", [
    (torch.optim.RAdam, {"guard_optimizer": True}, 5),
    (torch.optim.RMSprop, {}, 0),
    (torch.optim.Adagrad, {}, 0),
], ids=["radam-guard", "rmsprop-after-update", "adagrad-after-update"])
def test_eps0_with_a_feature_always_0_is_named(out_dir, opt_cls, kw, at):
    """``eps=0`` and a feature that is 0 in every record: its weights' gradients are all 0,
    so v = 0 and the update divides by 0. RAdam's 1 / (sqrt(v) + eps) made +inf first (its
    m = 0 then made NaN), and an update the bundle cannot re-run had no op at all: both hints
    said only 'check the learning rate and schedule, eps, and clip gradients'."""
    model = MM.make_classifier()
    opt = opt_cls(model.parameters(), lr=1e-3, eps=0.0)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="machinery_models:make_classifier", **kw):
            for step in range(8):
                x, y = MM.batch(step)
                x[:, 0] = 0.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (at, "optimizer", ["fc1.weight"])
    rep = nanreplay_json(err.bundle_path, code=0 if kw else 1)
    assert rep["cause"] == "optimizer" and rep["origin"]["param"] == "fc1.weight"
    assert rep["reproduced"] == bool(kw), rep
    assert EPS0 in rep["hint"], rep["hint"]


@pytest.mark.parametrize("factory,kind,op,param", [
    ("make_weight_norm_head", "_WeightNorm", "aten._weight_norm_interface",
     "head.parametrizations.weight.original1"),
    ("make_spectral_norm_head", "_SpectralNorm", "aten.div",
     "head.parametrizations.weight.original"),
])
def test_a_zero_initialised_layer_under_a_parametrization_names_its_parameter(
        out_dir, factory, kind, op, param):
    """A last layer zero-initialised, then put under weight_norm or spectral_norm: the
    parametrization divides by the weight's norm, 0/0. The hint said to add an eps to the
    denominator, which is torch's code; it now names the parametrization and its parameter of
    zeros, and how to start at 0 under weight_norm."""
    model = getattr(MM, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"machinery_models:{factory}"):
            for step in range(3):
                x, y = MM.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (0, "forward", "head.parametrizations.weight.0")
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == \
        ("head.parametrizations.weight.0", op)
    assert f"torch's {kind} parametrization of head.weight" in rep["hint"], rep["hint"]
    assert f"its parameter {param}, which is all 0" in rep["hint"], rep["hint"]
    assert "add an eps" not in rep["hint"]
    assert ("zero its magnitude original0" in rep["hint"]) == (kind == "_WeightNorm")


def _float16_with_a_scaler(out_dir, give: bool) -> None:
    """A float16 autocast run on the CPU under a GradScaler whose first scale (2**24) makes the
    scaled gradients overflow: it skips those steps, as it is meant to."""
    model = MM.make_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="machinery_models:make_classifier",
                        **({"scaler": scaler} if give else {})):
        for step in range(6):
            x, y = MM.batch(step)
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = crit(model(50 * x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() < 2.0 ** 24  # (it did skip)


def test_a_grad_scaler_not_given_to_the_recorder_is_said(out_dir):
    """Given the scaler, its skipped steps are no events; forgotten, the first skipped step is
    a backward event whose message blamed a loss 'computed outside the recorder' and whose
    report said to compute in float32. Both now say to pass the scaler."""
    _float16_with_a_scaler(out_dir / "given", give=True)
    assert not list((out_dir / "given").glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        _float16_with_a_scaler(out_dir, give=False)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    assert "pass FlightRecorder(..., scaler=scaler)" in str(err), str(err)
    rep = nanreplay_json(err.bundle_path)
    assert any("GradScaler scales this run's gradients but was not given" in p
               for p in rep["problems"]), rep["problems"]


def test_a_nan_weight_decay_of_sgd_is_re_run(out_dir):
    """Parameter groups with their own weight decay, one read as NaN from a sweep's config
    (YAML's ``.nan``). SGD's default ``weight_decay`` is the int 0, and the replay turned the
    bundle's 'nan' back into a float only where the default was a float: the guard re-run
    passed the string to ``torch.add(alpha=...)`` and the replay failed."""
    model = MM.make_classifier()
    opt = torch.optim.SGD([{"params": model.fc1.parameters(), "weight_decay": float("nan")},
                           {"params": model.fc2.parameters()}], lr=1e-2, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True,
                            factory="machinery_models:make_classifier"):
            x, y = MM.batch(0)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (0, "optimizer", ["fc1.weight", "fc1.bias"])
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    assert rep["origin"]["param"] == "fc1.weight"
    assert "its weight_decay was nan in that update" in rep["hint"], rep["hint"]


def test_a_tensor_learning_rate_gone_inf_is_named_from_the_window(out_dir):
    """``Adam(lr=torch.tensor(...))`` (as capturable and fused optimizers take it) under the
    same warm-up: the window's record holds the rate as a tensor, which the hint's check read
    as no number, so the re-run from the window said only 'check the learning rate'."""
    model = MM.make_classifier()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3), foreach=False)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info, np.errstate(divide="ignore"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (4 / np.float64(s)) ** 0.5)
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="machinery_models:make_classifier"):
            for step in range(4):
                x, y = MM.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                sched.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "optimizer"
    assert rep["origin"]["param"] == "fc1.weight"
    assert LR_INF in rep["hint"], rep["hint"]
