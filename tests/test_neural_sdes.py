"""End to end on hand-written neural SDEs (``neural_sdes_models``): a latent SDE integrated by
Euler-Maruyama with ``dW = sqrt(dt) * randn`` from the loop's Generator and its path KL, a
neural SDE fitted by the normalised increments of irregularly sampled series, and a score
model on a variance-exploding schedule. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_sdes_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_sdes_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "latent":
        xs, ts, noise = M.sine_batch(g)
        return (xs, ts, noise), (xs,)
    if kind == "irregular":
        xs, ts, mask = M.irregular_batch(g, duplicate=bad)
        return (xs, ts), (mask,)
    if kind == "well":
        args, target = M.well_batch(g, minutes=bad)
        return args, (target,)
    if kind == "vp":
        x, t, z = M.discrete_moons(g)
        return (x, t, z), (z,)
    x, t, z = M.two_moons(g)
    return (x, t, z), (z,)


LOSSES = {"latent": M.latent_loss, "irregular": M.increment_nll, "score": M.dsm_loss, "vp": M.dsm_loss,
          "well": M.path_mse}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, amp: bool = False):
    """Adam with an exponential decay and gradient clipping, as torchsde's examples train
    (``amp``: the forward and loss under bfloat16 autocast); the record ``bad`` is planted in
    the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999)
    crit = LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_sdes_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(*args)
                loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int | None = None, steps: int = 4):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, steps=steps)
    return info.value.event, info.value.bundle_path


def test_relu_diffusion_zero_in_the_path_kl_names_the_division_and_the_cut(tmp_path):
    """A latent SDE whose diffusion ends with a ReLU: ``g`` is exactly 0 wherever its
    pre-activation is negative, and the path KL's integrand ``(f - h) / g`` is x/0 at the first
    Euler-Maruyama step of the first batch. The replay names that division, its line, every
    row, and says the fix is a lower bound where ``g`` is made (softplus + eps), not an eps in
    the KL's denominator."""
    ev, bundle = fire("latent", "make_latent_relu", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "", "aten.div", "+inf", True), o
    assert o["source"] == line_of("u = (f - h) / g"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "a ReLU or clamp(min=0) made exactly 0" in rep["hint"], rep["hint"]
    assert "softplus(x) + eps" in rep["hint"], rep["hint"]


def test_duplicated_timestamp_names_the_normalised_increment_and_the_record(tmp_path):
    """One record's third observation logged twice: ``dt = 0`` between them, and the
    normalised increment ``(dx - f dt) / (g sqrt(dt))`` is x/0 in that record only. The event
    and the replay name the division on its line and sample 5, and say the divisor's 0 is its
    data factor's (dt), a degenerate record to repair where the data is made, not an eps to
    add (which would weight the transition by 1/eps); dropping it makes the step finite."""
    ev, bundle = fire("irregular", "make_irregular", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [5], "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", [5]), o
    assert o["source"] == line_of("eps = (xs[:, 1:] - x - f * dt) / (g * dt.sqrt())"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "or a factor of it, is a value no gradient reaches" in rep["hint"], rep["hint"]
    assert "duplicated timestamp's dt = 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_variance_exploding_schedule_with_sigma_min_zero_names_the_buffer(tmp_path):
    """``sigma_min = 0`` in ``sigma(t) = sigma_min (sigma_max / sigma_min) ** t``, the ends
    kept as a buffer: ``hi / lo`` is +inf and ``0 * inf ** t`` NaN in every row at step 0.
    The replay names the division first (then the product), every row, and the buffer's entry
    at 0 as the divisor: no record is to blame."""
    ev, bundle = fire("score", "make_score_zero_min", tmp_path, steps=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.div", "+inf", True), o
    assert o["source"] == line_of("return lo * (hi / lo) ** t"), o
    assert [c["op"] for c in o["chain"]] == ["aten.div", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the buffer sigma_range as the code keeps it, 0 at entry 0" in rep["hint"], rep


def test_times_in_minutes_overflow_the_double_well_drift_and_name_the_record(tmp_path):
    """One record's observation times logged in minutes among hours: its Euler-Maruyama steps
    are 60 times too long, the double well's ``-b x^3`` overshoots further each step, and
    ``x ** 3`` overflows at a later run of its line in that record only. The replay names the
    pow on its line, sample 9, overflow, and the times (``args[1]``) out of scale in that
    record, a wrong unit; dropping it makes the step finite."""
    ev, bundle = fire("well", "make_double_well", tmp_path, bad=9)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [9]), ev
    rep = nanreplay_json(bundle, "--try", "drop=9")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.pow", "+inf", [9]), o
    assert o["source"] == line_of("drift = self.net(x) + self.a * x - self.b * x ** 3"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "sample(s) 9 of args[1]" in rep["hint"] and "wrong unit" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def zero_time_rows(steps: int) -> tuple[int, list[int]]:
    """The first step whose batch of discrete times draws t = 0, and its rows."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        (_, t, _), _ = batch("vp", g, None)
        if bool((t == 0).any()):
            return step, torch.nonzero(t == 0).flatten().tolist()
    raise AssertionError("no t = 0 drawn")


def test_vp_score_at_a_discrete_time_zero_names_the_division_and_the_record(tmp_path):
    """A VP SDE's score model trained at DDPM-style discrete times ``randint(0, N) / N``:
    the first batch that draws t = 0 has a marginal std of exactly 0 there, and the score
    ``net(x_t, t) / std`` is x/0 in that record. The event and the replay name the division,
    its line, that step and that record, and say the divisor is a value of the data 0 in
    those records (sample t from [eps, 1]), not an eps to add."""
    step, rows = zero_time_rows(60)
    ev, bundle = fire("vp", "make_vp", tmp_path, steps=60)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        step, "forward", "", rows, "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "+inf", rows), o
    assert o["source"] == line_of("score = self.net(torch.cat([x_t, t[:, None]], 1)) / std"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "a value no gradient reaches" in rep["hint"], rep["hint"]
    assert "sample t from [eps, 1]" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make", [("latent", "make_latent"),
                                       ("irregular", "make_irregular"),
                                       ("score", "make_score"),
                                       ("well", "make_double_well")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """The softplus latent SDE (a GRU encoder, 9 Euler-Maruyama steps with the loop's noise),
    the sigmoid-diffusion SDE on irregular times without duplicates and the VE score model
    with sigma_min > 0: no event, bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3)
    plain = train(kind, make, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind,make", [("latent", "make_latent"), ("score", "make_score")])
def test_bfloat16_autocast_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """The latent SDE and the VE score model under bfloat16 autocast (the score divided by a
    sigma down to 0.01, the path KL over a softplus diffusion): no false alarm, and the
    weights are bit-identical with and without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3, amp=True)
    plain = train(kind, make, tmp_path, steps=3, record=False, amp=True)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
