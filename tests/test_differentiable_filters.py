"""End to end on differentiable filters (``differentiable_filters_models``): a Kalman filter
unrolled over a sequence with a learned transition, a learned heteroscedastic R and the
innovations' Gaussian log-likelihood through a Cholesky factor; a differentiable particle
filter with a learned observation likelihood, logsumexp-normalised log-weights and soft
resampling. Each planted bug of the domain fires under the recorder and is replayed with the
CLI; the healthy versions raise no event and train bit-identically with and without it."""

from __future__ import annotations

import contextlib

import differentiable_filters_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("differentiable_filters_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "ekf":
        x0, ranges, truth = M.ranged(g, bad)
        return (x0, ranges), (truth,)
    if kind.startswith("gaps"):  # "gaps_nan": the missing readings stored as NaN
        y, ctx, seen, truth = M.with_gaps(g, bad, filled=kind == "gaps_filled")
        return (y, ctx, seen), (truth,)
    if kind == "kalman":
        y, ctx, truth = M.tracks(g, bad)
        return (y, ctx), (truth,)
    z, truth = M.walks(g, bad)
    return (z,), (truth,)


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as the filters' papers train them; the
    sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = torch.nn.MSELoss() if kind in ("particle", "ekf") else M.kalman_loss
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the particles and their resampling)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"differentiable_filters_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = batch(kind, g, bad if step == steps - 1 else None)
            out = model(*args)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, bad: int, exc=NonFiniteError):
    with pytest.raises(exc) as info:
        train(kind, make, tmp_path, bad)
    return info.value


def test_kalman_r_softplus_of_an_out_of_scale_record_names_cholesky_and_the_record(tmp_path):
    """A record's signal strength logged in mW among W: ``r_net`` gives -2000, its softplus is
    0 even in float64, and with two sensors reading the same position ``S = H P H^T + R`` is
    singular for that sample alone, so ``torch.linalg.cholesky`` raises. The replay names the
    Cholesky, its line and sample 5, ``invalid`` (singular in float64 too), and says that
    sample's data is out of scale, not that a ridge is missing."""
    fire("kalman", "make_kalman", tmp_path, bad=5, exc=torch.linalg.LinAlgError)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"], o["module"], o["op"], o["made"],
            o["samples"]) == (True, 3, "", "aten.linalg_cholesky_ex", "LinAlgError", [5]), o
    assert o["source"] == line_of("L = torch.linalg.cholesky(S)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "sample(s) 5 of args[1] reach" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"] and "a ridge would hide" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_particle_filter_log_of_an_underflowed_likelihood_names_the_log_and_the_outlier(
        tmp_path):
    """An outlier observation 50 units off: ``exp(-d^2 / 2 sigma^2)`` underflows to 0 for every
    particle of that record, its log is -inf, ``logsumexp`` of all -inf is -inf and
    ``logw - lse`` is NaN. The event is the root's forward on sample 5; the replay names the
    ``log``, its line, sample 5, ``underflow`` with the log-space advice, and the outlier."""
    ev = fire("particle", "make_particle", tmp_path, bad=5).event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        3, "forward", "", "nan", [5]), ev
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("return torch.log(torch.exp(-0.5 * d2 / sigma2))"), o
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.sub"], o["chain"]
    assert rep["cause"] == "underflow", rep["cause"]
    assert "compute in log space" in rep["hint"] and "logsumexp" in rep["hint"], rep["hint"]
    assert "sample(s) 5 of" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]


def test_missing_readings_stored_as_nan_and_masked_after_the_update_say_fill_them(tmp_path):
    """Readings missing from the log are NaN beside a ``seen`` mask, and the filter keeps the
    prediction with ``torch.where(seen, updated, predicted)``: the forward is finite, but the
    where's backward turns 0 * NaN into NaN gradients (unrecorded, the weights turn NaN and
    the next step's Cholesky raises). The recorder stops at the first step on the input; the
    replay says the NaN lie only where ``args[2]`` marks readings missing, and to fill them
    before the model, not to add an eps to a std."""
    ev = fire("gaps_nan", "make_kalman", tmp_path, bad=None).event
    y, _, seen, _ = M.with_gaps(torch.Generator().manual_seed(0), None, filled=False)
    rows = torch.nonzero(~seen.all(1)).flatten().tolist()
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        0, "input", "args[0]", rows), ev
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["tensor"], rep["origin"]["samples"]) == (
        "input", "args[0]", rows), rep["origin"]
    assert "only where args[2] marks a value missing" in rep["hint"], rep["hint"]
    assert "nan_to_num" in rep["hint"] and "eps to the std" not in rep["hint"], rep["hint"]


def test_unrecorded_nan_gaps_break_the_weights_and_the_next_cholesky(tmp_path):
    """Without the recorder the same run's weights turn NaN after the first update, and the
    second step dies in ``torch.linalg.cholesky`` far from the data's fault: the event above
    is the bug, not a false alarm."""
    with pytest.raises(torch.linalg.LinAlgError):
        train("gaps_nan", "make_kalman", tmp_path, record=False)


@pytest.mark.parametrize("kind,make,bad", [("kalman", "make_kalman", None),
                                           ("gaps_filled", "make_kalman", 5),
                                           ("ekf", "make_ekf", None),
                                           ("particle", "make_particle_stable", 5)])
def test_healthy_filters_raise_nothing_and_train_the_same(tmp_path, kind, make, bad):
    """The Kalman filter on in-scale records, and on records whose gaps the loader filled with
    0 (the mask alone says they are missing), the range EKF on fixes off the sensor, and the
    particle filter whose log-likelihood
    stays in log space (the outlier's log-weights are about -1e4, finite, and logsumexp
    normalises them): no event, and bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, bad=bad)
    plain = train(kind, make, tmp_path, bad=bad, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_gated_particle_filter_whose_every_particle_is_gated_names_the_logsumexp(tmp_path):
    """Validation gating sets a particle's log-likelihood to -inf past a distance: for the
    outlier observation every particle of sample 5 is gated, ``logsumexp`` of the all -inf row
    is -inf and the normalisation ``logw - lse`` is NaN. The replay names the normalising
    ``logsumexp`` (not the intended ``masked_fill``, kept in the chain as intentional), sample
    5, ``invalid``, and says to keep one entry per row or use a large finite negative."""
    ev = fire("particle", "make_particle_gated", tmp_path, bad=5).event
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "forward", [5]), ev
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.logsumexp", "-inf", [5]), o
    assert o["source"] == line_of("logw = logw - torch.logsumexp(logw, dim=1, keepdim=True)")
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == [
        ("aten.masked_fill", True), ("aten.logsumexp", False)], o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "every entry is -inf" in rep["hint"], rep["hint"]
    assert "large finite negative" in rep["hint"], rep["hint"]


def test_ekf_range_jacobian_of_a_fix_at_the_sensor_names_the_division_and_the_record(
        tmp_path):
    """A range sensor's hand-written Jacobian ``x / |x|`` is 0/0 for a track whose initial fix
    is the sensor's own position (0, 0). The replay names that division, its line, sample 5,
    ``invalid``, and the record of zeros to drop or repair. The batch has as many tracks as
    range readings each (8): ``--try drop=5`` cuts the ranges ``(B, T)`` by row only (a
    non-negative square matrix, but beside the loss's track ``(B, T, 2)``: no pairwise one)."""
    ev = fire("ekf", "make_ekf", tmp_path, bad=5).event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("H = (x / r)[:, None, :]"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "norm of the batch's own records" in rep["hint"], rep["hint"]
    assert "drop or repair them" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
