"""End to end: an op that goes non-finite on a learnable parameter used as is (CLIP's
``logit_scale.exp()``, ``log(sigma)`` of a learned scale) is blamed on that op, and the hint
names the parameter and its value, so the fix goes to the parameter (bound it, parametrize
it, lower its learning rate), not to the op's inputs in general."""

from __future__ import annotations

import json

import pytest
import scale_models as SM
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(tmp_path, model, crit, opt, batch, factory: str, steps: int = 20):
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory=factory):
            for _ in range(steps):
                args, y = batch(g)
                opt.zero_grad()
                out = model(*args)
                loss = crit(*out) if y is None else crit(out, y)
                loss.backward()
                opt.step()
    err = info.value
    r = invoke_cli(err.bundle_path, "--json")
    assert r.exit_code == 0, r.stdout
    return err, json.loads(r.stdout)


def test_an_exp_of_a_logit_scale_that_grew_names_the_parameter(tmp_path):
    """The scale's group has its own learning rate, as CLIP recipes give it, here far too
    high: its first update takes it from log(1/0.07) past 88.7, and exp() of it overflows in
    the model's forward at the next step."""
    model = SM.make_clip()
    opt = torch.optim.SGD([{"params": [p for n, p in model.named_parameters()
                                       if n != "logit_scale"], "lr": 0.01},
                           {"params": [model.logit_scale], "lr": 300.0}])

    def batch(g):
        img = torch.randn(8, 12, generator=g)
        return (img, img + 0.05 * torch.randn(8, 12, generator=g)), None

    err, rep = train(tmp_path, model, SM.ClipLoss(), opt, batch, "scale_models:make_clip")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], rep["cause"]) == (
        "forward", "", "aten.exp", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert rep["event"]["step"] == err.event["step"] == 1 and rep["reproduced"] is True
    scale = float(torch.tensor(o["input_range"][0]))
    assert scale > 88.72  # log of float32's largest value
    assert f"aten.exp's input is the parameter logit_scale ({scale:.4g}): bound it where it " \
           "is used (logit_scale.clamp(max=...)) or lower its learning rate" in rep["hint"]


def test_a_log_of_a_learned_sigma_pushed_below_zero_names_the_parameter(tmp_path):
    model = SM.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # its first update: sigma 0.5 -> -0.94

    def batch(g):
        x = torch.randn(16, 6, generator=g)
        return (x,), x[:, :1] * 0.1  # a target the mean fits: sigma is driven down

    err, rep = train(tmp_path, model, SM.GaussianNLL(), opt, batch, "scale_models:make_regressor")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], rep["cause"]) == (
        "forward", "", "aten.log", "nan", "invalid"), json.dumps(rep, indent=1)
    assert err.event["step"] == 1
    assert rep["reproduced"] is True
    sigma = float(torch.tensor(o["input_range"][0]))
    assert sigma < 0
    assert f"aten.log's input is the parameter sigma ({sigma:.4g}): keep it in the op's " \
           "domain by construction" in rep["hint"]


def test_a_product_that_overflows_in_a_linear_names_no_parameter(tmp_path):
    """addmm takes the layer's bias and weight among its inputs: the hint of its overflow
    (a state carried across steps that grew, here a too-large input) is about the product,
    and names no parameter."""
    model = SM.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def batch(g):
        return (torch.rand(8, 4, generator=g) * 3e37 + 1e37,), torch.zeros(8, dtype=torch.long)

    err, rep = train(tmp_path, model, torch.nn.CrossEntropyLoss(), opt, batch, "scale_models:make_mlp",
                     steps=2)
    assert (rep["origin"]["op"], rep["cause"]) == ("aten.addmm", "overflow"), rep["origin"]
    assert "the parameter" not in rep["hint"], rep["hint"]
    assert "learned exponent" not in rep["hint"], rep["hint"]  # (a flow's advice, for exp)


def test_a_weight_made_by_a_modules_pre_hook_is_found_in_that_hook(tmp_path):
    """The old ``weight_norm`` makes the conv's weight in a forward pre-hook: a direction
    ``weight_v`` loaded as zeros (a bad resume) makes it 0/0 there. The replay's op finder
    starts before the module's own pre-hooks, so it names the op, not just the module."""
    model = SM.make_weight_normed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = iter(range(100))

    def batch(g):
        if next(steps) == 3:
            with torch.no_grad():
                model.convs[1].weight_v.zero_()
        x = torch.randn(2, 4, 16, generator=g)
        return (x,), x.mean(1)

    err, rep = train(tmp_path, model, torch.nn.L1Loss(), opt, batch,
                     "scale_models:make_weight_normed")
    o = rep["origin"]
    assert (err.event["step"], o["phase"], o["module"], o["op"], rep["cause"]) == (
        3, "forward", "convs.1", "aten._weight_norm_interface", "invalid"), o
    assert rep["reproduced"] is True


def test_a_non_finite_buffer_is_named_a_buffer(tmp_path):
    """A checkpoint whose BatchNorm running_var holds a NaN, loaded between steps: training
    batches never read it (train mode uses batch statistics), the first validation forward does.
    The origin is the weights, and the report calls running_var a buffer, not a parameter."""
    model = SM.make_bn_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="scale_models:make_bn_mlp"):
            for _ in range(3):
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
            state = model.state_dict()
            state["1.running_var"][3] = float("nan")  # a bad checkpoint
            model.load_state_dict(state)
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 4, generator=g))
    r = invoke_cli(info.value.bundle_path)
    assert "  origin     weights: nan made by buffer 1.running_var" in r.stdout.splitlines(), \
        r.stdout
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert (rep["origin"]["tensor"], rep["origin"]["param"], rep["cause"]) == (
        "buffer", "1.running_var", "weights")


@pytest.mark.parametrize("frozen", [False, True], ids=["validation", "frozen-bn"])
def test_a_negative_running_var_is_named_as_the_cause(tmp_path, frozen):
    """A converted checkpoint whose BatchNorm running_var holds -0.5 (finite, so no weights
    event): a validation forward in eval mode, or a fine-tuning loop that keeps its
    BatchNorms frozen in eval mode, takes the square root of running_var + eps. The cause
    read 'aten.native_batch_norm of a negative number (at a pole or outside its domain): clamp
    the op's input into its domain (x.clamp_min(eps) before log or sqrt)', which points at
    the activations; it now says the running variance is negative and how to fix the buffer."""
    model = SM.make_bn_mlp()
    state = model.state_dict()
    state["1.running_var"][3] = -0.5
    model.load_state_dict(state)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("1.")],
                          lr=0.01)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="scale_models:make_bn_mlp"):
            for _ in range(2):
                model.train()
                model[1].eval() if frozen else None  # frozen BatchNorm: running statistics
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 4, generator=g))
    ev = info.value.event
    assert (ev["module"], ev.get("evaluation", False)) == ("1", not frozen), ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], rep["cause"]) == \
        (True, "1", "aten.native_batch_norm", "invalid"), o
    # (the validation one: -0.5 moved towards the batches' variances by the training steps)
    low = "-0.5" if frozen else "-0.308"
    assert f"with a negative running variance (as low as {low})" in rep["hint"], rep["hint"]
    assert "running_var buffer was written so" in rep["hint"], rep["hint"]
