"""End to end on population PK/PD models (``pharmacokinetics_models``): covariate nets giving
log-normal individual parameters, the one-compartment Bateman function at each record's time
since dose, a sigmoid Emax effect with a fractional Hill coefficient, a combined or
proportional residual error model's Gaussian NLL with Beal's M3 for BLQ records, padded
records masked, a per-patient mean. Each planted bug or data condition of the domain fires
under the recorder and is replayed with the CLI; the healthy run raises no event and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pharmacokinetics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("pharmacokinetics_models.py", text)


def loader(steps: int, padded: bool = True) -> DataLoader:
    """``steps`` batches of ``N_PAT`` patients, as a DataLoader over the study's records."""
    g = torch.Generator().manual_seed(0)
    parts = [(*M.patients(g, padded=padded), M.durations()) for _ in range(steps)]
    return DataLoader(TensorDataset(*(torch.cat(t) for t in zip(*parts))),
                      batch_size=M.N_PAT, shuffle=False)


def train(make: str, out_dir, plant: str | None = None, bad: int = 3, steps: int = 4,
          record: bool = True, padded: bool = True, loss=None):
    """Adam over the model's and the error model's parameters, a step schedule and gradient
    clipping, as neural-NLME fits train; ``plant`` is done to patient ``bad`` of the last
    batch. Returns the model."""
    model = getattr(M, make)()
    crit = loss() if loss is not None else M.make_loss()
    opt = torch.optim.Adam([*model.parameters(), *crit.parameters()], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"pharmacokinetics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, b in enumerate(loader(steps, padded)):
            if plant is not None and step == steps - 1:
                b = (*M.plant(b[:6], plant, bad), M.plant_duration(b[6], plant, bad))
            cov, dose, tad, y, mask, blq, dur = b
            extra = {"make_infusion": (dur,), "make_amortised": (y, mask)}.get(make, ())
            out = model(cov, dose, tad, *extra)
            nll = loss_fn(out, y, mask, blq)
            opt.zero_grad()
            nll.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def padded_patients() -> list[int]:
    """The patients of the first batch with padded records (fewer than 6 samples)."""
    mask = next(iter(loader(1)))[4]
    return torch.nonzero(~mask.all(1)).flatten().tolist()


def test_bolus_coded_as_a_zero_length_infusion_names_the_rate_and_the_record(tmp_path):
    """A bolus dose entered as an infusion of duration 0 (patient 2): the rate ``D / dur``
    is +inf and the concentration NaN. The replay names the division on its line, the
    patient, the batch's own 0 as the divisor, and to repair the record or not take the op
    at a 0 that is valid (a bolus), not an eps."""
    ev, bundle = fire("make_infusion", tmp_path, plant="zero_duration", bad=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [2]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "+inf", [2]), o
    assert o["source"] == line_of("ke, rate = cl / v, (dose / dur)[:, None]"), o
    assert rep["cause"] == "invalid" and "the batch's own data" in rep["hint"], rep["hint"]
    assert "do not take the op at it" in rep["hint"], rep["hint"]


def test_equal_absorption_and_elimination_rates_name_the_bateman_pole(tmp_path):
    """ka and ke started at the same typical value (log 0) and the random-effects head
    zero-initialised: ka = ke in every patient, and the Bateman function's ``ka / (ka - ke)``
    is +inf, times ``exp(-ke t) - exp(-ka t) = 0``. The replay names the division on every
    row; zeroing the head alone is not the pole (with ones in its place the rates are still
    equal), so the hint says so and sends the user to start the rates apart or take the
    limit where they meet, not to an eps or a random init."""
    ev, bundle = fire("make_pk_same_rates", tmp_path, steps=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.div", "+inf", True), o
    assert o["source"] == line_of("return dose[:, None] / v * ka / (ka - ke)"), o
    assert rep["cause"] == "invalid", rep
    assert "ka = ke" in rep["hint"] and "zero start is not" not in rep["hint"], rep["hint"]
    assert "only hides what else makes them equal" in rep["hint"], rep["hint"]
    assert "limit" in rep["hint"] and "AF2" not in rep["hint"], rep["hint"]


def test_m3_through_erf_masked_by_where_names_the_log_backward(tmp_path):
    """Beal's M3 written as ``-log(0.5 (1 + erf(z / sqrt 2)))`` over every record, kept
    only at BLQ ones by ``torch.where``: at a quantified peak z is about -10, erf rounds to
    -1, Phi to 0, and the unselected branch's -inf sends NaN through the where's backward at
    step 0. The replay names LogBackward0 in the loss, on its line: precision, since exact
    arithmetic keeps 0.5 (1 + erf) above 0 (the graph alone, whose nodes keep no scalars,
    cannot tell 1 + y from y + c: the re-run notes it), with log_ndtr(z), and the where that
    still sends the gradient through the dropped branch."""
    ev, bundle = fire("make_pk", tmp_path, loss=lambda: M.make_loss(exact_tail=False))
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"]) == ("backward", "<loss>", "LogBackward0"), o
    assert o["source"] == line_of("return -torch.log(0.5 * (1 + torch.erf("), o
    assert rep["cause"] == "precision", rep
    assert "torch.special.log_ndtr(z)" in rep["hint"], rep["hint"]
    assert "the forward dropped the op's output there" in rep["hint"], rep["hint"]


def blq_patients(step: int) -> list[int]:
    """The patients of batch ``step`` with a BLQ record."""
    blq = list(loader(step + 1))[step][5]
    return torch.nonzero(blq.any(1)).flatten().tolist()


def test_m3_through_erf_at_a_blq_record_names_the_rounded_normal_cdf(tmp_path):
    """The same erf-based M3, taken of the BLQ records alone (indexed, then scattered back):
    at step 1 the first BLQ record (patient 4's 24 h sample) is predicted far above the
    LLOQ early in the fit, erf rounds to -1 and log(Phi) is log(0) in the loss. Float64 keeps
    Phi positive there, so the cause is precision, and the hint gives log_ndtr(z) for a
    normal cdf written as 0.5 (1 + erf(z / sqrt 2)), not a variance's cancellation."""
    assert blq_patients(1) == [4]
    ev, bundle = fire("make_pk", tmp_path, loss=lambda: M.make_loss(exact_tail=False,
                                                                    blq_only=True))
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [4]), o
    assert o["source"] == line_of("return -torch.log(0.5 * (1 + torch.erf("), o
    assert rep["cause"] == "precision", rep
    assert "log Φ(z) of 0.5·(1 + erf(z/√2)) = torch.special.log_ndtr(z)" in rep["hint"], \
        rep["hint"]
    assert "variance" not in rep["hint"], rep["hint"]


def test_proportional_error_at_a_predose_sample_names_the_log_of_sigma(tmp_path):
    """A proportional-only error model (``sigma = b C``, the additive term 0) and a pre-dose
    sample kept in the data: C = 0 there (time clamped at 0), so ``log(sigma^2)`` is -inf in
    patient 3 at the last step. The replay names the log on its line, the patient, and the
    additive term of 0 as an eps that guards nothing."""
    ev, bundle = fire("make_pk", tmp_path, plant="predose", padded=False,
                      loss=lambda: M.make_loss(additive=0.0))
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [3]), o
    assert o["source"] == line_of("nll = 0.5 * (torch.log(sigma ** 2)"), o
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]


def test_proportional_error_at_padded_records_names_the_where_backward(tmp_path):
    """The same error model over padded patients: padded records hold time 0, C = 0 and
    sigma = 0, and the M3 term's ``(LLOQ - C) / sigma`` is +inf there, dropped by the
    ``torch.where`` in forward but NaN through its backward at step 0. The replay names
    DivBackward0 on the z line, exactly the patients with padding, and the where."""
    ev, bundle = fire("make_pk", tmp_path, loss=lambda: M.make_loss(additive=0.0))
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == (
        "<loss>", "DivBackward0", padded_patients()), o
    assert o["source"] == line_of("z = (LLOQ - pred) / sigma"), o
    assert rep["cause"] == "invalid" and "both branches" in rep["hint"], rep["hint"]


def test_negative_time_since_dose_names_the_exp_and_the_record(tmp_path):
    """Records sorted by clock time across a day change: one sample of patient 3 has a time
    since dose of -150 h (no 10x outlier among 0-24 h), the model does not clamp it, and
    ``exp(-ka t)`` overflows there. The replay names the exp, the patient, overflow, and the
    record's negative time in ``args[2]`` where every other patient's are 0 or more;
    dropping it makes the step finite."""
    ev, bundle = fire("make_pk_untouched_time", tmp_path, plant="unsorted")
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.exp", "+inf", [3], "overflow"), rep
    assert o["source"] == line_of("return dose[:, None] / v * ka / (ka - ke)"), o
    assert "sample(s) 3 of args[2] hold negative values (down to -150)" in rep["hint"], \
        rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_negative_time_under_a_weibull_absorption_names_the_power_and_the_record(tmp_path):
    """The same wrongly sorted record under Weibull absorption: ``(t / td) ** beta`` with a
    fractional beta is NaN at t = -150 h. The replay names the pow, the patient, and the
    record's negative time in ``args[2]`` beside the op's own advice (a clamp at 0 would
    hide a corrupt record as a pre-dose sample)."""
    ev, bundle = fire("make_weibull", tmp_path, plant="unsorted", padded=False)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "forward", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.pow", "nan", [3]), o
    assert o["source"] == line_of("absorbed = 1 - torch.exp(-(tad / td)"), o
    assert rep["cause"] == "invalid" and "negative number to a fractional power" in rep["hint"]
    assert "sample(s) 3 of args[2] hold negative values (down to -150)" in rep["hint"], \
        rep["hint"]


def test_negative_time_as_a_log_time_feature_names_the_value_as_given(tmp_path):
    """The same record fed to an MLP surrogate as ``log1p(t)``: NaN at -150. The replay
    names the log1p, the patient, and the value the op took as the batch gave it, once (the
    negative-record note defers to it)."""
    ev, bundle = fire("make_log_time", tmp_path, plant="unsorted")
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "forward", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log1p", "nan", [3]), o
    assert o["source"] == line_of("x = torch.cat([cov[:, None].expand(n, t, N_COV)"), o
    assert rep["cause"] == "invalid", rep
    assert "args[2] holds -150 at sample(s) 3 (column 3) as the batch gave it" in rep["hint"]
    assert "hold negative values" not in rep["hint"], rep["hint"]


def test_patient_with_no_observations_names_the_per_patient_mean(tmp_path):
    """A patient dosed but with every sample lost (all padding): the per-patient mean
    ``nll.sum(1) / mask.sum(1)`` is 0/0 in that row. The replay names the division, the
    patient, and the empty record with the count floor."""
    ev, bundle = fire("make_pk", tmp_path, plant="no_obs", bad=5)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.div", "nan", [5]), o
    assert o["source"] == line_of("return (nll.sum(1) / mask.sum(1)).mean()"), o
    assert rep["cause"] == "invalid" and "empty records" in rep["hint"], rep["hint"]
    assert "clamp_min(1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_empty_patient_in_the_second_accumulated_micro_batch_is_named_there(tmp_path):
    """Gradient accumulation over two micro-batches of patients (AdamW, the loss halved):
    the patient with no observations sits in the second micro-batch of step 2. The event and
    the replay name that micro-batch and the patient's row within it."""
    model, crit = M.make_pk(), M.make_loss()
    opt = torch.optim.AdamW([*model.parameters(), *crit.parameters()], lr=1e-2)
    batches = iter(loader(6))
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=crit, out_dir=tmp_path,
            factory="pharmacokinetics_models:make_pk") as rec:
        for step in range(3):
            opt.zero_grad()
            for k in range(2):
                b = next(batches)[:6]
                if (step, k) == (2, 1):
                    b = M.plant(b, "no_obs", 6)
                cov, dose, tad, y, mask, blq = b
                (rec.loss_fn(model(cov, dose, tad), y, mask, blq) / 2).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (2, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"]) == (1, "aten.div", [6]), o
    assert "empty records" in rep["hint"] and "--try drop=6" in rep["hint"], rep["hint"]


def test_blq_exported_as_zero_under_a_log_transform_names_the_target(tmp_path):
    """Log-transform-both-sides error, and one BLQ result exported as 0 instead of flagged
    (patient 5's 8 h sample): ``log(y)`` is -inf in the loss. The replay names the log, the
    patient, the target computed from the data alone, and to leave positions holding no
    target out of the loss with a mask."""
    ev, bundle = fire("make_pk", tmp_path, plant="blq_as_zero", bad=5, padded=False,
                      loss=M.LogTransformLoss)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [5]), o
    assert o["source"] == line_of("res = (torch.log(y) - torch.log(pred))"), o
    assert rep["cause"] == "invalid" and "batch's data alone" in rep["hint"], rep["hint"]
    assert "leave those out of the loss with a mask" in rep["hint"], rep["hint"]


def test_log_transform_over_padded_records_names_the_log_and_the_padding(tmp_path):
    """The same LTBS loss over padded patients, the padding dropped by ``nll[mask]`` after
    the log: padded records hold y = 0 and C = 0 (time 0), log(0) - log(0) is NaN, and the
    square's backward multiplies it at step 0. The replay names PowBackward0 with the log
    that made the NaN in its chain, exactly the patients with padding, and the padding to
    keep out of the op's input."""
    ev, bundle = fire("make_pk", tmp_path, loss=M.LogTransformLoss)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == (
        "<loss>", "PowBackward0", padded_patients()), o
    assert [c["source"] for c in o["chain"]] == [
        line_of("res = (torch.log(y) - torch.log(pred))"), o["source"]], o["chain"]
    assert "zero padding" in rep["hint"] and "before the op" in rep["hint"], rep["hint"]


def test_fractional_hill_coefficient_at_zero_concentration_names_the_pow_backward(tmp_path):
    """The Emax model's ``C ** h`` with h = 0.7 at the padded records' C = 0: finite in
    forward, but the exponent's derivative ``C^h log C`` is 0 * -inf there. The replay names
    PowBackward1 in the root's forward on its line, exactly the patients with padding, and
    says to make the base safe before the op."""
    ev, bundle = fire("make_pd", tmp_path, loss=M.EffectLoss)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("", "PowBackward1", padded_patients()), o
    assert o["source"] == line_of("ch = c ** h"), o
    assert rep["cause"] == "invalid" and "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_steep_hill_of_a_dose_in_micrograms_names_the_exponent_gradient(tmp_path):
    """A steep Emax curve (h near 10) and one patient's dose entered in micrograms among
    milligrams: C near 7e3 there, C^h still finite, but the Hill coefficient's gradient
    ``C^h log C`` overflows. The replay names PowBackward1 on the power's line, overflow of
    the power's derivative (no pole near 0, whose advice, log space for a tiny input, would
    mislead), and patient 3's dose 1000x every other's; dropping it makes the step finite."""
    ev, bundle = fire("make_pd_steep", tmp_path, plant="dose_in_ug", loss=M.EffectLoss)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"]) == ("", "PowBackward1"), o
    assert o["source"] == line_of("ch = torch.where(on, c, 1.0) ** h * on"), o
    assert rep["cause"] == "overflow" and "a learned exponent's" in rep["hint"], rep["hint"]
    assert "pole (1/y" not in rep["hint"] and "tiny" not in rep["hint"], rep["hint"]
    assert "sample(s) 3 of args[1] reach 1e+05, 1e+03x" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("blq_only", [False, True])
def test_healthy_fit_raises_nothing_and_trains_the_same(tmp_path, blq_only):
    """The combined error model, M3 through ``log_ndtr`` (whose -log at quantified peaks is
    large but finite, then dropped by the where; or taken of the BLQ records alone and
    scattered back), padding and BLQ records: no event, and bit-identical weights with and
    without the recorder."""
    loss = lambda: M.make_loss(blq_only=blq_only)  # noqa: E731
    recorded = train("make_pk", tmp_path, loss=loss)
    plain = train("make_pk", tmp_path, record=False, loss=loss)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_healthy_emax_fit_over_padding_raises_nothing_and_trains_the_same(tmp_path):
    """The Emax model with its base made safe at C = 0 (``where(c > 0, c, 1) ** h``, then
    0): no event at the padded records, and bit-identical weights."""
    recorded = train("make_pd_safe", tmp_path, loss=M.EffectLoss)
    plain = train("make_pd_safe", tmp_path, record=False, loss=M.EffectLoss)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_patient_with_no_observations_under_amortised_attention_names_the_softmax(tmp_path):
    """Amortised inference over a patient with every record padding: the attention pool's
    softmax takes a row of -inf only, NaN for that patient. The replay names the softmax on
    its line, the patient and the fully masked row; the NaN eta then meets the padded
    record's time of 0 in ``exp(-ke * t)``, data's own 0, not a mask meant to drop it, so
    the hint does not call it one."""
    ev, bundle = fire("make_amortised", tmp_path, plant="no_obs", bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten._softmax", "nan", [5]), o
    assert o["source"] == line_of("w = self.score(h).squeeze(-1).masked_fill(~mask"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]
    assert "a mask's 0" not in rep["hint"], rep["hint"]


def test_amortised_attention_over_padded_records_raises_nothing_and_trains_the_same(tmp_path):
    """Amortised inference: the attention pool's padding is -inf before the softmax in every
    step, and stays inside it (each patient has records): no event, and bit-identical
    weights with and without the recorder."""
    recorded = train("make_amortised", tmp_path)
    plain = train("make_amortised", tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
