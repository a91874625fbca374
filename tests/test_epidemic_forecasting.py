"""End to end on epidemic forecasting models (``epidemic_forecasting_models``): an SEIR model
integrated by explicit Euler in the forward with beta(t) from a mobility network, a renewal
model (a truncated, renormalised generation interval, a random-walk log R_t, a reporting-delay
``conv1d``), both fitted by a masked negative binomial likelihood, and a GRU forecaster of log
incidence. Each planted failure of the domain fires under the recorder and is replayed with
the CLI; the healthy versions raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import contextlib

import epidemic_forecasting_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCHES = {"seir": M.seir_batch, "renewal": M.renewal_batch, "log": M.log_incidence_batch,
           "metapop": M.seir_batch, "where": M.seir_batch, "observed": M.seir_batch}
LOSSES = {"seir": M.seir_loss, "renewal": M.renewal_loss, "metapop": M.seir_loss,
          "where": M.where_masked_loss, "observed": M.observed_loss}


def line_of(text: str) -> str:
    return source_line("epidemic_forecasting_models.py", text)


def train(kind: str, make: str, out_dir, bad: dict | None = None, steps: int = 4,
          record: bool = True, **data):
    """Adam with a step schedule and gradient clipping over rolling windows of regions; the
    data condition ``bad`` (a keyword of the batch maker) is planted in the last step's
    batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"epidemic_forecasting_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            args, targets = BATCHES[kind](g, **(bad if bad and step == steps - 1 else {}),
                                          **data)
            loss = loss_fn(model(*args), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, steps: int = 4, **bad):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, steps=steps)
    return info.value.event, info.value.bundle_path


def test_padded_region_of_population_zero_names_the_force_of_infection(tmp_path):
    """Regions padded to a fixed batch with population 0 (mask 0 in the loss): the force of
    infection ``beta * S * I / N`` is 0/0 there. The replay names the division, its line, the
    padded slot, and the divisor as the batch's own data, exactly 0: repair or mask it, no
    eps."""
    ev, bundle = fire("seir", "make_seir", tmp_path, padded=6)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [6], "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.div", "nan", [6]), o
    assert o["source"] == line_of("force = beta[:, t] * s * i / pop"), o
    assert rep["cause"] == "invalid" and "batch's own data" in rep["hint"], rep["hint"]
    assert "mask the sample" in rep["hint"], rep["hint"]


def test_padded_region_masked_by_a_product_names_the_log_and_the_mask(tmp_path):
    """A metapopulation SEIR that guards its padding (population taken as 1, contacts masked
    with -inf): the padded region's expected cases are exactly 0, the likelihood's
    ``log(mu / (phi + mu))`` is -inf there, ``cases * log`` 0 * -inf, and ``ll * mask`` keeps
    the NaN. The replay names the log, the padded slot, and the mask's product, with the
    where-before-the-op / select-first advice (it said the 0 was a constant the model wrote,
    with a pointer-generator's vocabulary slots as the example)."""
    ev, bundle = fire("metapop", "make_metapop", tmp_path, padded=6)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf",
                                                                [6]), o
    assert o["source"] == line_of("+ phi * torch.log(phi / (phi + mu))"), o
    mask_line = line_of("return -(ll * mask).sum() / mask.sum()")
    assert rep["cause"] == "invalid", rep
    assert f"multiplied by a mask's 0 in aten.mul ({mask_line})" in rep["hint"], rep["hint"]
    assert "x[mask.bool()]" in rep["hint"] and "vocabulary" not in rep["hint"], rep["hint"]


def test_padded_region_masked_by_where_names_the_log_backward(tmp_path):
    """The same likelihood with ``torch.where(mask > 0, ll, 0)``: the loss is finite, but the
    where's zero gradient meets log's derivative at mu = 0 (0 / 0): a backward event, named
    at LogBackward0 on the padded slot, with the where-before-the-op advice."""
    ev, bundle = fire("where", "make_metapop", tmp_path, padded=6)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"]) == ("backward", "LogBackward0", [6]), o
    # (the log line of where_masked_loss's own likelihood, 4 lines below its def)
    at = line_number("epidemic_forecasting_models.py", "def where_masked_loss") + 4
    assert o["source"] == f"epidemic_forecasting_models.py:{at}", o
    assert rep["cause"] == "invalid" and "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_daily_euler_step_past_the_susceptibles_names_the_nb_log_and_the_region(tmp_path):
    """One Euler step a day and a region whose mobility index came in percent: beta is ~100x,
    the step ``dt * beta * S * I / N`` takes more than S, S goes negative and the expected
    incidence with it, and the negative binomial's ``log(mu / (phi + mu))`` is NaN: a loss
    event. The replay names that log, the region, and its out-of-scale covariates."""
    ev, bundle = fire("seir", "make_seir_daily", tmp_path, hot=2)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == ("loss", "<loss>", "aten.log",
                                                                 [2]), o
    assert o["source"] == line_of("+ phi * torch.log(phi / (phi + mu))"), o
    assert rep["cause"] == "invalid" and "negative" in rep["hint"], rep["hint"]
    assert "sample(s) 2 of args[0]" in rep["hint"] and "out of scale" in rep["hint"], rep
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_raw_population_feature_overflows_nb2_alpha_and_lgamma_names_the_record(tmp_path):
    """NB2's overdispersion ``alpha = exp(w . features)`` per region, phi = 1 / alpha: a
    region's static features joined with the population unlogged (1e5 among standardised
    values) overflow alpha, phi is exactly 0, and the likelihood's ``lgamma(phi)`` is at its
    pole: a loss event. The replay names the lgamma, the region, and (as for a domain) its
    out-of-scale features rather than only an eps: a clamp on phi would train on the record
    (it said "clamp ... or add an eps" alone); dropping the region makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train("seir", "make_seir_regional", tmp_path, {"raw": 5}, features=True)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.lgamma", "+inf",
                                                                [5]), o
    assert o["source"] == line_of("ll = (torch.lgamma(cases + phi) - torch.lgamma(phi)"), o
    assert rep["cause"] == "invalid" and "pole" in rep["hint"], rep["hint"]
    assert "sample(s) 5 of args[2]" in rep["hint"] and "to its pole" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_generation_interval_truncated_where_it_has_no_mass_names_the_renormalisation(
        tmp_path):
    """A region's serial interval taken from a table in hours (mean ~125 'days'): truncated at
    14 days, the lognormal's CDF differences are all 0 in float32 (``1 + erf`` of a very
    negative z), and the renormalisation ``w / w.sum()`` is 0/0 in that region's row. The
    replay names the division, the region, and precision: float64 keeps a tiny mass there."""
    ev, bundle = fire("renewal", "make_renewal", tmp_path, hours=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [3]), o
    assert o["source"] == line_of("return w / w.sum(-1, keepdim=True)"), o
    # (float64 keeps a mass of ~1e-16 in the window: the 0 is float32's 1 + erf(z) cancelling)
    assert rep["cause"] == "precision" and "0 by 0" in rep["hint"], rep["hint"]
    assert "catastrophic cancellation" in rep["hint"], rep["hint"]


def overflowing_regions() -> tuple[int, list[int], list[int]]:
    """In an unrecorded step 0 of the year-long model: the day the renewal loop's infections
    first overflow, the regions they overflow in that day, and every region they overflow in
    by the year's end (each region's recursion is its own: no row feeds another)."""
    model = M.make_renewal_long()
    (region, seed, logmean, logsd), _ = M.renewal_batch(torch.Generator().manual_seed(0),
                                                        horizon=365)
    with torch.no_grad():
        w = model.generation_interval(logmean, logsd)
        rt = torch.exp(model.log_r0[region, None] + torch.cumsum(model.walk[region], 1))
        infections, first = [seed] * model.max_gi, None
        for t in range(rt.shape[1]):
            new = rt[:, t] * (torch.stack(infections[::-1][:model.max_gi], 1) * w).sum(1)
            if first is None and not torch.isfinite(new).all():
                first = t, torch.nonzero(~torch.isfinite(new)).flatten().tolist()
            infections.append(new)
    ever = ~torch.isfinite(torch.stack(infections, 1)).all(1)
    return *first, torch.nonzero(ever).flatten().tolist()


def test_random_walk_r_t_over_a_year_overflows_in_the_renewal_loop(tmp_path):
    """R_t starting at R0 = 2.5 over a 365-day horizon: infections grow by 2.5 a generation
    and overflow float32 inside the renewal loop at step 0, late in the year and first in the
    regions an unrecorded run finds. The replay names the product with R_t on its line, every
    region whose own recursion overflows within the loop (the first day's and a later
    day's), overflow, and the loop diverging run after run."""
    day, first, rows = overflowing_regions()
    assert day > 300 and first == [3] and rows == [1, 3], (day, first, rows)
    with pytest.raises(NonFiniteError) as info:
        train("renewal", "make_renewal_long", tmp_path, steps=1, horizon=365)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.mul", "+inf", rows), o
    assert o["source"] == line_of("infections.append(rt[:, t] * (past * w).sum(1))"), o
    assert rep["cause"] == "overflow" and "diverging" in rep["hint"], rep["hint"]


def test_region_reporting_no_case_makes_a_log_target_of_minus_inf(tmp_path):
    """A region whose reporting froze for the whole window: ``log(cases)`` is -inf in its
    history and its targets. The GRU's saturating gates keep the forecast finite, so the
    event is the loss target's -inf on that region; the replay names the input, the region,
    and log(0) of a count."""
    ev, bundle = fire("log", "make_forecaster", tmp_path, silent=4)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"], ev["kind"]) == (
        3, "input", "loss_args[1]", [4], "-inf"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [4], "input"), rep
    assert "log of a count" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,data", [("seir", "make_seir", {}),
                                            ("observed", "make_metapop", {"padded": 6}),
                                            ("renewal", "make_renewal", {}),
                                            ("log", "make_forecaster", {"log1p": True})])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, data):
    """Sub-daily Euler SEIR, the metapopulation SEIR with a padded region in every batch (its
    -inf contact mask stays inside the softmax; the likelihood takes the observed entries
    only), the renewal model and the GRU on log1p targets: no event, and bit-identical
    weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, steps=3, **data)
    plain = train(kind, make, tmp_path, steps=3, record=False, **data)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def window_loader(silent: int | None, steps: int):
    """A DataLoader over the rolling windows of 16 regions a step (two batches of 8),
    log-transformed; ``silent``: the window, counted over the whole set, of a region whose
    reporting froze."""
    g = torch.Generator().manual_seed(0)
    parts = [M.log_incidence_batch(g) for _ in range(2 * steps)]
    history = torch.cat([args[0] for args, _ in parts])
    target = torch.cat([t[0] for _, t in parts])
    if silent is not None:
        history[silent], target[silent] = float("-inf"), float("-inf")  # log(0) of every day
    data = torch.utils.data.TensorDataset(history, target)
    return torch.utils.data.DataLoader(data, batch_size=M.REGIONS, shuffle=False)


def train_accumulated(out_dir, silent: int | None = None, steps: int = 3, record: bool = True):
    """Two batches accumulated per update (``loss / 2``), clipping, Adam."""
    model = M.make_forecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = torch.nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="epidemic_forecasting_models:make_forecaster") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for k, (history, target) in enumerate(window_loader(silent, steps)):
            (loss_fn(model(history), target) / 2).backward()
            if k % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad()
    return model


def test_zero_case_window_in_an_accumulated_batch_names_its_micro_batch_and_row(tmp_path):
    """Window 44 of the loader (the last step's second batch, row 4) is a region with no
    case: its log target is -inf. The event and the replay name micro-batch 1 and row 4."""
    with pytest.raises(NonFiniteError) as info:
        train_accumulated(tmp_path, silent=2 * 2 * M.REGIONS + M.REGIONS + 4)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"], ev["kind"]) == (
        2, "input", 1, [4], "-inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["micro_batch"], o["samples"], rep["cause"]) == ("input", 1, [4],
                                                                          "input"), rep
    assert "log of a count" in rep["hint"], rep["hint"]


def test_accumulated_healthy_run_trains_the_same(tmp_path):
    recorded = train_accumulated(tmp_path)
    plain = train_accumulated(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
