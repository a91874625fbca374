"""End to end on training written with ``torch.func`` (``torch_func_training_models``): an
ensemble of stacked weights run by ``vmap(functional_call)`` and trained by Adam, DP-SGD by
``vmap(grad_and_value(...))`` clipped and noised by hand, a Jacobian Frobenius penalty by
``vmap(jacrev(model))`` in a loss wrapper, MAML with ``torch.func.grad`` inner steps and
``functional_call`` on the adapted parameters; each run under the recorder until a planted bug
fires, then replayed with the CLI."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_func_training_models as M
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

FACTORY = "torch_func_training_models:"


def line_of(text: str) -> str:
    return source_line("torch_func_training_models.py", text)


def train_ensemble(model, opt, loader, rec=None, epochs: int = 2):
    loss_fn = rec.loss_fn if rec is not None else M.gaussian_nll
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()


def fit_ensemble(out_dir, **data):
    model = M.make_ensemble()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.gaussian_nll, out_dir=out_dir,
                            factory=FACTORY + "make_ensemble") as rec:
            train_ensemble(model, opt, M.regression_loader(**data), rec)
    return info.value


def test_healthy_ensemble_trains_bit_identically_and_raises_nothing(tmp_path):
    """Hooks on the stacked ensemble (its members run by vmap(functional_call) on a meta-device
    copy): no event, and the same weights bit for bit as without the recorder."""
    plain, recorded = M.make_ensemble(), M.make_ensemble()
    opt_a = torch.optim.Adam(plain.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(recorded.parameters(), lr=1e-2)
    train_ensemble(plain, opt_a, M.regression_loader())
    with FlightRecorder(recorded, opt_b, loss_fn=M.gaussian_nll, out_dir=tmp_path,
                        factory=FACTORY + "make_ensemble") as rec:
        train_ensemble(recorded, opt_b, M.regression_loader(), rec)
    assert rec.health.internal_errors == 0 and not list(tmp_path.glob("*.nan"))
    assert all(torch.equal(a, b) for a, b in zip(plain.stacked, recorded.stacked))


def test_ensemble_input_nan_names_the_record(tmp_path):
    """A missing reading left as NaN in record 37 (batch 2 of 16, row 5)."""
    err = fit_ensemble(tmp_path, nan_row=37)
    assert (err.event["step"], err.event["phase"]) == (2, "input")
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["reproduced"], rep["origin"]["samples"]) == ("input", True, [5])
    assert "sample 5 at feature(s) 2" in rep["hint"], rep["hint"]


def test_ensemble_member_variance_overflow_is_named_inside_vmap(tmp_path):
    """Record 21 in other units (x 2000): every member's ``exp(log_var)`` overflows for it,
    inside vmap(functional_call), named at the ensemble's call with the member's line."""
    err = fit_ensemble(tmp_path, scaled_row=21)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (1, "forward", "")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "overflow", "", "aten.exp", "+inf", [5]), rep
    assert o["source"] == line_of("var = torch.exp(self.log_var(x))")
    assert "data of these samples is out of scale" in rep["hint"], rep["hint"]


def test_dp_sgd_user_cross_entropy_underflow_names_the_outlier(tmp_path):
    """DP-SGD by vmap(grad_and_value): the user's ``-log(softmax(z)[y])`` of an outlier (record
    21: batch 1, row 5) whose label's probability underflows to 0; the plain forward's loss is
    +inf at step 1."""
    model, crit = M.make_classifier(), M.SoftmaxNLL()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory=FACTORY + "make_classifier") as rec:
            for x, y in M.class_loader(far_row=21):
                M.dp_sgd_step(model, opt, crit, x, y, gen=g)
    assert rec.health.internal_errors == 0
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "underflow", "<loss>", "aten.log", "-inf", [5]), rep
    assert o["source"] == line_of("return -torch.log(p).mean()")
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def test_jacobian_penalty_of_a_fully_masked_record_is_an_invalid_sqrt_backward(tmp_path):
    """``sqrt(sum(J**2))`` of ``vmap(jacrev(model))`` in the loss wrapper: record 3 of step 2
    has every feature masked, its Jacobian is 0 and sqrt's derivative there +inf. The float64
    re-run's hooks on the model met its calls under vmap(jacrev) too, read their batched
    gradients on the host and raised, so the cause was not told."""
    model = M.make_relunet()
    crit = M.JacobianReg(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory=FACTORY + "make_relunet") as rec:
            for x, mask, y in M.jacobian_batches(blank_at=2):
                opt.zero_grad()
                rec.loss_fn(model(x, mask), y, x, mask).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "SqrtBackward0", [3]), rep
    assert o["source"] == line_of("frob = torch.sqrt((jac ** 2).sum(dim=(1, 2)))")
    assert "raised in the float64 re-run" not in rep["hint"], rep["hint"]


def test_maml_query_record_of_zeros_is_named_through_functional_call(tmp_path):
    """MAML by torch.func.grad; the query forward by functional_call on the adapted weights
    divides query record 2 of step 2 (all zeros) by its norm."""
    model = M.make_normed()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=tmp_path,
                            factory=FACTORY + "make_normed") as rec:
            for xs, ys, xq, yq in M.tasks(blank_query_at=2):
                M.maml_step(model, opt, xs, ys, xq, yq, loss_fn=rec.loss_fn)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward", "")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "", "aten.div", "nan", [2]), rep
    assert o["source"] == line_of("x = x / x.norm(dim=-1, keepdim=True)")
    assert "those records are all zeros" in rep["hint"], rep["hint"]


def test_maml_inner_loop_overflow_names_the_weights_the_loop_made(tmp_path):
    """Sinusoid MAML: 5 inner steps by torch.func.grad (unrecorded), the query forward by
    functional_call on the adapted weights; the task of step 2 comes with a gain of 1e4, its
    inner steps blow the adapted weights up and net.0 makes NaN from a finite input. The
    bundle holds the model's own weights, so the re-run is finite; the report blamed 'state
    outside the model ... or transient', and now names weights the loop passed in."""
    model = M.make_sinenet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.MSELoss(), out_dir=tmp_path,
                            factory=FACTORY + "make_sinenet") as rec:
            for xs, ys, xq, yq in M.sine_tasks(loud_at=2):
                M.maml_step(model, opt, xs, ys, xq, yq, inner_lr=0.01, inner_steps=5,
                            loss_fn=rec.loss_fn)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward",
                                                                            "net.0")
    rep = nanreplay_json(err.bundle_path, code=1)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["call"], o["made"]) == (
        False, None, "net.0", 0, "nan"), rep
    assert any("weights the bundle does not hold (net.0.weight, net.0.bias)" in p
               for p in rep["problems"]), rep["problems"]
    assert "were most likely not the model's own" in rep["hint"], rep["hint"]


def test_bf16_ensemble_bce_on_probabilities_is_a_precision_loss(tmp_path):
    """A pure-bfloat16 ensemble of scorers, the user's BCE on ``sigmoid(logits)``: an easy
    positive record (21: batch 1, row 5) gets a logit of about 8 from one member, whose
    sigmoid rounds to 1 in bfloat16; ``log(1 - p)`` is -inf, times ``1 - y`` = 0 NaN."""
    model, crit = M.make_scorer_ensemble(bf16=True), M.EnsembleBCE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory=FACTORY + "make_scorer_ensemble",
                            factory_kwargs={"bf16": True}) as rec:
            for x, y in M.binary_loader(sure_row=21):
                opt.zero_grad()
                rec.loss_fn(model(x.bfloat16()), y.bfloat16()).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "precision", "<loss>", "aten.log", "-inf", [5]), rep
    assert o["source"] == line_of("return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))")
    assert "rounded to 1 in bfloat16" in rep["hint"], rep["hint"]


def test_sliced_score_matching_divergence_is_an_overflow_that_says_lower_the_lr(tmp_path):
    """Sliced score matching, the Hutchinson term by torch.func.jvp beside the plain forward;
    SGD at lr 30 diverges and the gradients overflow at step 4 in the last layer's backward."""
    model = M.make_scorenet()
    opt = torch.optim.SGD(model.parameters(), lr=30.0)
    g = torch.Generator().manual_seed(5)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory=FACTORY + "make_scorenet"):
            for _ in range(8):
                x = torch.randn(32, 4, generator=g) * 0.5 + 1
                v = torch.randn(32, 4, generator=g)
                opt.zero_grad()
                M.sliced_score_loss(model, x, v).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"]) == ("overflow", "net.4", "AddmmBackward0"), rep
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]


def test_maml_second_order_nan_through_unrecorded_inner_loop_is_not_blamed_on_the_factory(
        tmp_path):
    """A cosine classifier (each side over its norm plus an eps), MAML by torch.func.grad: the
    support record 4 of step 2 is all zeros, its embedding's norm is 0, the inner gradient is
    finite (the norm's derivative is masked there) but the outer backward differentiates it
    again: NaN in embed.weight's gradient. The query forward ran on the adapted weights, so
    the fidelity check found 'embed' differing and the report said the factory builds a
    different model; the factory builds the recorded modules, and the report now says the call
    likely ran with weights passed in by functional_call."""
    model = M.make_cosinenet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=tmp_path,
                            factory=FACTORY + "make_cosinenet") as rec:
            for xs, ys, xq, yq in M.blank_support_tasks(blank_at=2):
                M.maml_step(model, opt, xs, ys, xq, yq, loss_fn=rec.loss_fn)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "backward")
    assert "embed.weight" in err.event["params"]
    rep = nanreplay_json(err.bundle_path, code=1)
    fid = rep["fidelity"]
    assert (rep["reproduced"], rep["cause"]) == (False, None)
    assert (fid["matches"], fid["module"], fid["call"], fid["same_build"]) == (
        False, "embed", 0, True), fid
    assert "factory builds a different model" not in rep["hint"], rep["hint"]
    assert "ran with other weights" in rep["hint"], rep["hint"]
