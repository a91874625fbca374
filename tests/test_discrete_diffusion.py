"""End to end on discrete diffusion written as MDLM, D3PM and SEDD write it
(``discrete_diffusion_models``): per-sample diffusion times, padded token sequences, the SUBS
``-inf`` on the [MASK] logit, the masked ELBO weight ``alpha' / (1 - alpha)``, D3PM's
posterior as a normalised product of ``Q_t`` and ``Q_bar_{t-1}`` rows, SEDD's score entropy
(also in log space, with a ``log(1 - exp(-x))`` helper). Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy runs raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import discrete_diffusion_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS_D3PM = 8


def line_of(text: str) -> str:
    return source_line("discrete_diffusion_models.py", text)


def batch(kind: str, g: torch.Generator, plant: str | None, bad: int):
    """(model args, loss args after the model's outputs) of one step; ``plant`` breaks
    sample ``bad``."""
    x0, pad = M.text_batch(g)
    if kind == "d3pm":
        t = torch.randint(1, STEPS_D3PM + 1, (len(x0),), generator=g)
        x_t = M.noise_absorbing(x0, t, STEPS_D3PM, g)
        if plant == "unreachable":  # token-replacement augmentation run on x_t, not on x_0
            x_t[bad, 1] = x0[bad, 1] % (M.MASK - 1) + 1
            t[bad] = 2
        return (x0, x_t, t, pad), (pad,)
    t = torch.rand(len(x0), generator=g)
    if plant == "t0":
        t[bad] = 0.0  # torch.rand can return exactly 0
    if plant == "t1":
        t[bad] = 1.0  # a stratified sampler's last stratum, t = 1 included
    return (x0, t, pad), (x0,)


LOSSES = {"mdlm": M.mdlm_loss, "cosine": M.mdlm_loss, "d3pm": M.d3pm_loss,
          "sedd": M.score_entropy, "sedd_log": M.score_entropy_logspace}


def train(kind: str, make: str, out_dir, plant: str | None = None, bad: int = 3,
          steps: int = 4, record: bool = True, allow_inf=("",)):
    """AdamW with warmup, gradient clipping, as MDLM's
    and SEDD's trainers run; the plant is in the last step's batch. ``allow_inf=[""]`` lets
    the root output hold SUBS's ``-inf`` [MASK] log-probability. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    crit = LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the masking draws inside forward)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"discrete_diffusion_models:{make}",
                         allow_inf=list(allow_inf)) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, extra = batch(kind, g, plant if step == steps - 1 else None, bad)
            out = model(*args)
            loss = loss_fn(*out, *extra)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, plant: str, bad: int = 3):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, plant, bad)
    return info.value.event, info.value.bundle_path


def test_mdlm_time_zero_names_the_elbo_weight_division_and_the_sample(tmp_path):
    """``torch.rand`` draws t = 0 for sample 3: alpha_t = 1, so MDLM's weight
    ``alpha' / (1 - alpha)`` divides by 0 (-inf) and, as no token of that sample is masked at
    t = 0, the mask's 0 turns it into NaN. A loss event; the replay names the division, its
    line, sample 3, a pole, and that the mask applied after it cannot keep it out."""
    ev, bundle = fire("mdlm", "make_mdlm", tmp_path, "t0")
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "-inf", [3]), o
    assert o["source"] == line_of("weight = dalpha / (1 - alpha)"), o
    assert rep["cause"] == "invalid" and "by 0" in rep["hint"], rep["hint"]
    assert "mask's 0" in rep["hint"] and "skip the rows" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_cosine_schedule_at_one_names_the_log_of_a_rounded_negative_alpha(tmp_path):
    """A stratified sampler gives t = 1 to sample 3: ``cos(pi / 2)`` is -4.4e-8 in float32
    (6.1e-17 in float64), and ``sigma = -log(alpha)`` is NaN inside the model, whose root
    ``allow_inf`` lets its output hold SUBS's -inf. That NaN is no allowed infinity: the
    replay blames the log on sample 3 with its evidence, as precision (rounding crossed the
    domain edge), and says to clamp before it, not to rescale or widen an overflow."""
    ev, bundle = fire("cosine", "make_mdlm_cosine", tmp_path, "t1")
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "", 0, "aten.log", "nan", [3]), o
    assert o["source"] == line_of("return alpha, -math.pi / 2 * torch.sin"), o
    assert rep["cause"] == "precision", rep["hint"]
    assert "negative" in rep["hint"] and "clamp" in rep["hint"], rep["hint"]
    # (named as what it is: a cosine at its zero that rounding took below 0, not a variance)
    assert "cosine or sine at one of its zeros" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_d3pm_unreachable_transition_names_the_posterior_normaliser(tmp_path):
    """An augmentation replaced a token of x_t but not of x_0 in sample 3: under the
    absorbing kernel that x_t cannot come from that x_0, every entry of
    ``Q_t[:, x_t] * x_0 Q_bar_{t-1}`` is 0, and the posterior's normalisation is 0/0 in the
    model's forward. The replay names that division, its line, sample 3, and tells the user to
    keep such ids out of the batch; dropping the sample makes the step finite."""
    ev, bundle = fire("d3pm", "make_d3pm", tmp_path, "unreachable")
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("return unnorm / unnorm.sum(-1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "keep those ids out of the batch" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_sedd_time_zero_names_the_reciprocal_of_expm1(tmp_path):
    """SEDD at t = 0: sigma = 0, the absorbing graph's ratio ``1 / expm1(sigma)`` is +inf
    in the loss, and ``ratio * (log ratio - 1)`` with the mask's 0 makes NaN. The replay names
    the reciprocal on sample 3 as a pole."""
    ev, bundle = fire("sedd", "make_sedd", tmp_path, "t0")
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.reciprocal", "+inf", [3]), o
    assert o["source"] == line_of("ratio = 1 / esigm1[:, None]"), o
    assert rep["cause"] == "invalid" and "of 0 (a pole" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_log1mexp_at_zero_names_the_log_in_the_log_space_score_entropy(tmp_path):
    """The log-space score entropy's ``log(1 - exp(-sigma))`` helper without a guard: at
    t = 0, sigma = 0 and it is log(0). The replay names that log (not the exp or the mask's
    product after it) on sample 3, a pole, and says to clamp its input away from 0."""
    ev, bundle = fire("sedd_log", "make_sedd", tmp_path, "t0")
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "-inf", [3]), o
    assert o["source"] == line_of("return torch.log(-torch.expm1(-x))"), o
    assert rep["cause"] == "invalid" and "pole at 0" in rep["hint"], rep["hint"]
    assert "clamp" in rep["hint"] and rep["what_if"][0]["finite"] is True, rep


def test_subs_minus_inf_without_allow_inf_says_to_allow_the_root(tmp_path):
    """Without ``allow_inf`` SUBS's ``logits[..., MASK] = -inf`` reaching the output is an
    event at the first step: the replay names that fill in the root as intended (no op
    overflowed), on every sample, not the -inf padding mask the encoder layer fills first
    (its softmax takes it back to finite values), and its note gives the pattern that lets the
    root output hold it, ``allow_inf=['']``, or says to mask with ``finfo.min`` (MDLM's own
    code adds -1e6)."""
    with pytest.raises(NonFiniteError) as info:
        train("mdlm", "make_mdlm", tmp_path, allow_inf=())
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["chain"][0]["intentional"]) == ("", "aten.fill_", True), o
    assert o["source"] == line_of('logits[..., MASK] = float("-inf")'), o
    assert o["samples"] == list(range(8)), o
    assert rep["cause"] == "invalid" and "finfo(dtype).min" in rep["hint"], rep["hint"]
    assert any("allow_inf=['']" in p for p in rep["problems"]), rep["problems"]


@pytest.mark.parametrize("kind,make", [("mdlm", "make_mdlm"), ("d3pm", "make_d3pm"),
                                       ("sedd", "make_sedd"), ("sedd_log", "make_sedd"),
                                       ("cosine", "make_mdlm_cosine")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """SUBS's -inf [MASK] log-probability under ``allow_inf=[""]`` (gathered only at real
    tokens), the padding masks, the masking draws inside forward, D3PM's posterior with its
    exact zeros: no event, and bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3)
    plain = train(kind, make, tmp_path, steps=3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
