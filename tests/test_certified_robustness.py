"""End to end on certified-robustness training written by hand (``certified_robustness_models``):
CROWN-IBP's interval bounds in centre-radius form through the hidden layers, the CROWN
relaxation of the last ReLU with its upper slope ``u / (u - l)``, the worst-case margin loss
under auto_LiRPA's epsilon schedule ramped from 0, Adam with gradient clipping. Each planted
bug fires under the recorder and is replayed with the CLI; the guarded version raises no
event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import certified_robustness_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

SLOPE = "upper_d = ub_r / (ub_r - lb_r)"


def train(make: str, out_dir, warmup: int, steps: int = 4, bad: int | None = None,
          record: bool = True):
    """CROWN-IBP's loop: eps from ``eps_schedule``, the loss on the clean logits and the
    margins' lower bounds, clipping at 10; sample ``bad`` of step 2 is a record left in
    0-255 (not divided by 255). Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.ibp_loss, out_dir=out_dir,
                         factory=f"certified_robustness_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.ibp_loss
        for step in range(steps):
            x, y = M.batch(g)
            if step == 2 and bad is not None:
                x[bad] = x[bad] * 255 + 2
            logits, margin_lb = model(x, M.eps_schedule(step, warmup, 2, 0.1), y)
            loss = loss_fn(logits, margin_lb, y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_crown_slope_at_epsilon_zero_names_the_division_on_every_sample(tmp_path):
    """At the schedule's first step eps is 0, every interval is a point (``u == l``) and the
    slope ``u / (u - l)`` is ±inf; ``unstable * upper_d`` turns it into NaN. The replay names
    the division, its line, step 0 and every sample, as invalid math with the eps advice, and
    says the mask multiplied after the op does not keep the infinity out."""
    ev, path = fire("make_crown", tmp_path, warmup=1)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(M.N)))
    rep = nanreplay_json(path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], rep["event"]["step"], o["module"], o["op"],
            o["samples"], o["made"]) == (
        True, "invalid", 0, "", "aten.div", list(range(M.N)), "+inf"), rep
    assert o["source"] == source_line("certified_robustness_models.py", SLOPE), o
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    assert "mask applied after the op" in rep["hint"], rep["hint"]


def test_crown_slope_of_a_record_left_in_0_255_names_its_sample(tmp_path):
    """Past warm-up eps is 0.1, but one record of step 2 was never divided by 255: clamped to
    the image domain [0, 1] its box is the point 1, so its intervals are flat and its slope is
    x/0. The replay names that sample alone, step 2, the division and its line, and its
    precursors say the input batch's scale jumped."""
    ev, path = fire("make_crown", tmp_path, warmup=0, bad=5)
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "forward", [5])
    rep = nanreplay_json(path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], rep["event"]["step"], o["module"], o["op"],
            o["samples"]) == (True, "invalid", 2, "", "aten.div", [5]), rep
    assert o["source"] == source_line("certified_robustness_models.py", SLOPE), o
    assert [p["kind"] for p in rep["precursors"]] == ["absmax_jump"], rep["precursors"]
    assert "input batch" in rep["precursors"][0]["detail"], rep["precursors"]


def test_guarded_crown_ibp_raises_nothing_and_trains_identically(tmp_path):
    """auto_LiRPA's ``u = max(u, l + 1e-8)``: the warm-up's point intervals and the ramp train
    without an event, and the recorder changes no weight bit."""
    seen = train("make_crown_guarded", tmp_path, warmup=2, steps=5)
    bare = train("make_crown_guarded", tmp_path, warmup=2, steps=5, record=False)
    for (name, a), b in zip(seen.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def test_crown_slope_guard_rounded_away_is_precision_and_shows_the_eps(tmp_path):
    """``u = max(u, l + 1e-8)`` on the unclamped bounds: 1e-8 is far below float32's spacing
    at |l| ~ 0.5, so at eps 0 ``l + 1e-8 == l`` and the divisor is still 0. Float64 keeps the
    1e-8, so the replay says precision and shows float64's divisor (the eps the user wrote),
    not the numerator it differs in too: the report showed a float64 value of ``u`` beside
    "by 0", which reads as the divisor."""
    ev, path = fire("make_crown_naive_guard", tmp_path, warmup=1)
    assert (ev["step"], ev["phase"], ev["samples"]) == (0, "forward", list(range(M.N)))
    rep = nanreplay_json(path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["samples"]) == (
        True, "precision", "aten.div", list(range(M.N))), rep
    assert o["source"] == source_line("certified_robustness_models.py", SLOPE), o
    assert "by 0 (x/0, a pole) (float64 has 1e-08 there)" in rep["hint"], rep["hint"]


def train_deep(out_dir, eps_max: float, steps: int = 3, record: bool = True):
    """Gowal et al.'s IBP on a 14-layer MLP under float16 autocast (as on a GPU with AMP),
    eps ramped over 4 steps; Adam. Returns the model."""
    model = M.make_deep_ibp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.deep_ibp_loss, out_dir=out_dir,
                         factory="certified_robustness_models:make_deep_ibp") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.deep_ibp_loss
        for step in range(steps):
            x, y = M.batch(g)
            with torch.autocast("cpu", dtype=torch.float16):
                logits, lo, hi = model(x, M.eps_schedule(step, 0, 4, eps_max))
                loss = loss_fn(logits, lo, hi, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_deep_ibp_bounds_overflowing_float16_name_the_interval_and_float32(tmp_path):
    """At eps 0.25 the 14 layers' interval radii ``|W| r`` grow past float16's 65504 in the
    12th layer; ``mu - r`` is -inf there and ``mu + r`` then ``inf - inf``. The replay names
    the subtraction, its line, that run of it, and an overflow of float16 that float32
    holds: compute the bounds outside autocast. The line runs once per layer, its values
    growing run after run; the report called that a diverging loop "which a wider type only
    postpones" (a Newton-Schulz or fixed-point iteration's advice), but each run took its own
    layer's weights: growth through depth, which float32 holds."""
    with pytest.raises(NonFiniteError) as info:
        train_deep(tmp_path, 1.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["line_run"]) == (
        True, "overflow", "aten.sub", "-inf", 12), rep
    assert o["source"] == source_line("certified_robustness_models.py", "return mu - r, mu + r")
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "compute this op in float32 (outside autocast" in rep["hint"], rep["hint"]
    assert "diverging" not in rep["hint"] and "postpones" not in rep["hint"], rep["hint"]
    assert not any("run after run" in p for p in rep["problems"]), rep["problems"]


def test_deep_ibp_at_a_small_epsilon_raises_nothing_and_trains_identically(tmp_path):
    """At eps_max 0.01 the float16 bounds stay finite: no event, and the same weights as an
    unrecorded run."""
    seen = train_deep(tmp_path, 0.01)
    bare = train_deep(tmp_path, 0.01, record=False)
    for (name, a), b in zip(seen.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob("*.nan"))


def train_smoothing(out_dir, steps: int = 30):
    """Gaussian-noise training of a smoothed classifier with a certified-radius hinge
    (``radius_loss``), SGD with momentum, on separable data: as the base classifier grows
    confident, a soft p_A rounds to 1."""
    model = M.make_smoothing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the noise of randn_like)
    with FlightRecorder(model, opt, loss_fn=M.radius_loss, out_dir=out_dir,
                        factory="certified_robustness_models:make_smoothing") as rec:
        for _ in range(steps):
            x, y = M.batch(g)
            x = x + 3 * torch.nn.functional.one_hot(y, M.D).float()
            loss = rec.loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_smoothing_radius_of_p_a_clamped_to_a_bound_float32_rounds_to_one(tmp_path):
    """``p_a.clamp(1e-8, 1 - 1e-8)`` then ``ndtri``: 1 - 1e-8 is 1.0 in float32, so a
    confident sample's p_A is clamped onto 1, ndtri is +inf, the hinge ``relu(gamma - r)``
    keeps it out of the loss, and ndtri's backward multiplies the saved +inf by 0. The replay
    names ndtri's backward node, its line, the sample, precision, and says the code's clamp
    bound is 1 in float32 with the eps float32 resolves (it said "clamp to the domain before
    the op", which the code already does)."""
    with pytest.raises(NonFiniteError) as info:
        train_smoothing(tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (19, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "precision", "<loss>", "SpecialNdtriBackward0", [11]), rep
    assert o["source"] == source_line("certified_robustness_models.py", "torch.special.ndtri(p_a)")
    hint = rep["hint"]
    assert "the code clamps already, but its bound 0.99999999 is 1 in float32" in hint, hint
    # (no float32 advice for what is float32 already; float64 does keep 1 - 1e-8 off the edge)
    assert "eps of at least 5.96e-08" in hint and "clamped in float32" not in hint, hint
    assert "compute what is clamped in float64" in hint, hint
