"""The training tricks of timm's and DeiT's scripts (``training_tricks_models``: stochastic
depth, LayerScale, per-sample mixup with label smoothing and SoftTargetCrossEntropy, ModelEmaV3
as a distillation teacher, layer-wise lr decay groups, adaptive gradient clipping, a cosine
schedule with warm-up through LambdaLR, bf16 autocast, gradient accumulation, channels_last),
trained under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import training_tricks_models as M
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "training_tricks_models.py"


def train(model, opt, factory, steps, *, out_dir=None, loss_fn=None, mixup=None, ema=None,
          sched=None, clip=None, teacher=False, accum=1, bf16=False, epochs=20):
    """DeiT's train_one_epoch: mixup on the batch, the forward under autocast, the EMA
    teacher's logits for the distillation loss, accumulation, clipping before step(), the
    scheduler per update and the EMA after it. The error of the event, or None (with
    ``out_dir=None``: no recorder)."""
    loss_fn = loss_fn or M.SoftTargetCrossEntropy()
    step = 0

    def loop():
        nonlocal step
        for _ in range(epochs):
            for i, (x, y) in enumerate(M.loader()):
                x = x.contiguous(memory_format=torch.channels_last)
                if mixup is not None:
                    x, y = mixup(x, y)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(x)
                    if teacher:
                        with torch.no_grad():
                            t = ema(x)
                        loss = loss_fn(out, t, y)
                    else:
                        loss = loss_fn(out, y)
                (loss / accum).backward()
                if (i + 1) % accum:
                    continue
                if clip is not None:
                    clip(model.parameters())
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
                step += 1
                if ema is not None:
                    ema.update(model, step)
                if step >= steps:
                    return

    if out_dir is None:
        loop()
        return None
    try:
        with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                            factory=f"training_tricks_models:{factory}"):
            loop()
    except NonFiniteError as e:
        return e
    return None


def _healthy(out_dir):
    model = M.make_model()
    groups = M.param_groups_layer_decay(model)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] = 1e-3 * g["lr_scale"]
    ema = M.ModelEmaV3(model, decay=0.99, use_warmup=True)
    err = train(model, opt, "make_model", 6, out_dir=out_dir, mixup=M.Mixup(), ema=ema,
                sched=M.cosine_with_warmup(opt, 2, 6), clip=M.adaptive_clip_grad, accum=2,
                bf16=True)
    return err, model, ema


def test_healthy_recipe_is_no_event_and_trains_bit_identically(out_dir, caplog):
    """Every trick at once (layer decay groups, mixup with smoothing, drop path, LayerScale,
    AGC, accumulation under bf16 autocast, warm-up cosine, EMA with warm-up): no event, no
    warning, and the same weights and EMA weights as without the recorder."""
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING):
        err, model, ema = _healthy(out_dir)
    assert err is None, err.event
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(Path(out_dir).glob("*.nan"))
    torch.manual_seed(3)
    _, plain, plain_ema = _healthy(None)
    for a, b in zip(list(model.state_dict().values()) + list(ema.state_dict().values()),
                    list(plain.state_dict().values()) + list(plain_ema.state_dict().values())):
        assert torch.equal(a, b)


def test_drop_path_rate_1_names_the_division_by_keep_prob_0(out_dir):
    """--drop-path 1.0: the last block's keep_prob is 0, drop_path's x.div(keep_prob) is
    +/-inf and its product with the all-0 mask NaN, in every sample."""
    model = M.make_deep_drop()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = train(model, opt, "make_deep_drop", 4, out_dir=out_dir, mixup=M.Mixup())
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "blocks.2.drop_path1"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == \
        (True, "invalid", "blocks.2.drop_path1", "aten.div", "+inf"), o
    assert o["source"] == source_line(MODELS, "output = x.div(keep_prob)")
    assert o["samples"] == list(range(16)) and o["all_samples"]
    assert "keep_prob = 1 - p = 0" in rep["hint"], rep["hint"]


def test_mixup_alpha_0_names_the_nan_lambda_of_the_whole_batch(out_dir):
    """Mixup(mixup_alpha=0): Johnk's Beta sampler draws U^(1/0) = 0 twice and lambda is 0/0,
    for every sample: the mixed batch is NaN throughout before the model sees it. The hint
    named a diffusion sampler's division as its example; now also the mixing weight."""
    model = M.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = train(model, opt, "make_model", 4, out_dir=out_dir, mixup=M.Mixup(mixup_alpha=0.0))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "batch"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["made"]) == \
        (True, "input", "batch", "nan"), o
    assert o["samples"] == list(range(16)) and o["all_samples"]
    assert "every value of batch is NaN" in rep["hint"], rep["hint"]
    assert "mixup lambda from Beta(0, 0)" in rep["hint"], rep["hint"]


def test_agc_eps_0_names_the_weight_to_gradient_norm_ratio_of_zero_weights(out_dir):
    """Unit-wise AGC with eps=0 under a zero-initialised head: every parameter before the head
    has a gradient of 0 at step 0, and the zero-initialised ones (biases, cls_token) a weight
    norm of 0 too: max_norm / grad_norm is 0/0 there, NaN. The hint said 'a per-parameter
    gradient normalisation g / g.norm() without eps, keep the eps (X / (X.norm() + eps))';
    the parameters whose weights are not 0 stayed finite, which names the ratio of norms."""
    model = M.make_zero_head()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    err = train(model, opt, "make_zero_head", 3, out_dir=out_dir,
                loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1),
                clip=lambda ps: M.clip_ratio_grad(ps, eps=0.0))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "backward", "cls_token"), ev
    assert len(ev["params"]) == 20 and all(
        n == "cls_token" or n.endswith("bias") for n in ev["params"]), ev
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["made"]) == \
        (False, "invalid", "cls_token", "nan"), o
    hint = rep["hint"]
    assert "exactly the parameters whose weights are all 0 as well" in hint, hint
    assert "max(|W|, eps) / max(|G|, eps) with eps = 0" in hint, hint
    assert "head.weight are all 0 in the bundle" in hint, hint
    assert "g / g.norm() without eps" not in hint, hint


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_warmup_of_0_steps_names_the_nan_learning_rate(out_dir):
    """warmup_steps from numpy ints (0 epochs x 4): min(step / warmup_steps, 1.0) is 0/0 at
    step 0, NaN (numpy warns, no ZeroDivisionError), so LambdaLR sets every lr to NaN and
    AdamW's first update writes NaN into every weight."""
    model = M.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning):
        sched = M.cosine_with_warmup(opt, M.warmup_steps_of(0, 4), 8)
    err = train(model, opt, "make_model", 3, out_dir=out_dir, sched=sched,
                loss_fn=nn.CrossEntropyLoss(label_smoothing=0.1))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "cls_token"), ev
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"]) == (False, "optimizer", "cls_token"), o
    assert "its lr was nan in that update" in rep["hint"], rep["hint"]
    assert "a division by a step count of 0" in rep["hint"], rep["hint"]


def test_ema_teacher_with_decay_above_1_names_the_teacher_and_the_decay(out_dir):
    """ModelEmaV3(decay=1.5) without warm-up as DeiT's distillation teacher: each update
    lerps with weight 1 - decay = -0.5, away from the model, the EMA weights grow 1.5x per
    step until its logits overflow and its log_softmax is NaN. The loss argument holding
    them is named; the hint suspected only a non-finite momentum."""
    model = M.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = M.ModelEmaV3(model, decay=1.5)
    err = train(model, opt, "make_model", 200, out_dir=out_dir, ema=ema, teacher=True,
                loss_fn=M.DistillationLoss(nn.CrossEntropyLoss()), epochs=100)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"]) == (43, "input", "loss_args[1]"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"]) == (True, "input", "loss_args[1]"), o
    assert o["samples"] == ev["samples"] and 4 not in o["samples"], o
    assert "(teacher_outputs)" in rep["hint"], rep["hint"]
    assert "a decay above 1" in rep["hint"], rep["hint"]
    assert "its finite entries reach 6.69e+09" in rep["hint"], rep["hint"]
    assert "an EMA whose decay is above 1 lerps with weight 1 - decay < 0" in rep["hint"]


def _two_step(which, out_dir):
    """timm's Lookahead around AdamW (its step), or davda54's ASAM over SGD (first_step to
    w + e(w), a second forward and backward, second_step back to w and the base step),
    recorded with the optimizer whose step() updates: the wrapper, SAM's base_optimizer."""
    model = M.make_model()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    if which == "lookahead":
        opt = recorded = M.Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-3), k=3)
    else:
        opt = M.SAM(model.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, lr=0.1,
                    momentum=0.9)
        recorded = opt.base_optimizer

    def loop():
        for x, y in M.loader(n=96):
            crit(model(x), y).backward()
            if which == "lookahead":
                opt.step()
                opt.zero_grad()
            else:
                opt.first_step(zero_grad=True)
                crit(model(x), y).backward()
                opt.second_step(zero_grad=True)

    if out_dir is None:
        loop()
    else:
        with FlightRecorder(model, recorded, loss_fn=crit, out_dir=out_dir,
                            factory="training_tricks_models:make_model") as rec:
            loop()
        assert rec.health.internal_errors == 0
    return model


@pytest.mark.parametrize("which", ["lookahead", "sam"])
def test_lookahead_and_sam_train_bit_identically_under_the_recorder(out_dir, caplog, which):
    """Lookahead's slow update after its base step (its state beside the base's moments) and
    SAM's weights moved between a step's two forwards: both train with no event and no
    warning, to the same weights as without the recorder."""
    with caplog.at_level(logging.WARNING):
        model = _two_step(which, out_dir)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(Path(out_dir).glob("*.nan"))
    plain = _two_step(which, None)
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_sam_given_itself_warns_to_record_its_base_optimizer(out_dir, caplog):
    """Given SAM itself, whose step() the loop never calls (first_step and second_step step
    its base_optimizer), the recorder warns that the optimizer it was given never stepped;
    the warning now names what to give it instead: optimizer.base_optimizer."""
    model = M.make_model()
    crit = nn.CrossEntropyLoss()
    opt = M.SAM(model.parameters(), torch.optim.SGD, lr=0.1)
    with caplog.at_level(logging.WARNING), \
            FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        for x, y in M.loader(n=48):
            crit(model(x), y).backward()
            opt.first_step(zero_grad=True)
            crit(model(x), y).backward()
            opt.second_step(zero_grad=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "never stepped" in warned[0], warned
    assert "FlightRecorder(model, optimizer.base_optimizer)" in warned[0], warned


def test_pure_float16_adamw_names_eps_lost_in_float16(out_dir):
    """model.half() with AdamW's default eps=1e-8, which float16 rounds to 0: under the
    zero-initialised head every gradient before it is 0 at step 0, and m / (sqrt(v) + eps) is
    0/0 in every one of those parameters (underflow of the eps, not of the data)."""
    model = M.make_zero_head().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    err = None
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="training_tricks_models:make_zero_head"):
            for x, y in M.loader(n=32):
                crit(model(x.half()).float(), y).backward()
                opt.step()
                opt.zero_grad()
    except NonFiniteError as e:
        err = e
    ev = err.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == (0, "optimizer", "cls_token"), ev
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"]) == (False, "optimizer", "cls_token"), o
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]
