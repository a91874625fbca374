"""End to end: causal-inference and uplift models (``causal_inference_models``: DragonNet,
CFRNet/TARNet with an IPM penalty, a TARNet under inverse propensity weights, a DR-learner's
second stage), trained under the recorder on batches of which some hold one arm only, until a
planted bug fires; then ``nanreplay`` on the bundle, as a user runs it."""

from __future__ import annotations

import json

import causal_inference_models as M
import pytest
import torch
from bundles import line_number, nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> int:
    return line_number("causal_inference_models.py", text)


def train(out_dir, make: str, loss_fn, data: tuple, *, batch_size: int, epochs: int = 1,
          shuffle: bool = False, takes_t: bool = False):
    """Adam with a step schedule over a DataLoader of ``(x, t, y, *extra)``; the model takes
    the treatment too where ``takes_t`` (CFRNet's factual head). Returns the batches' arms."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(*data), batch_size=batch_size, shuffle=shuffle,
                        generator=g)
    arms = []
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=f"causal_inference_models:{make}") as rec:
        for _ in range(epochs):
            for x, t, y, *extra in loader:
                arms.append(int(t.sum()))
                opt.zero_grad()
                out = model(x, t) if takes_t else model(x)
                rec.loss_fn(out, y, t, *extra).backward()
                opt.step()
                sched.step()
    return arms


def rare_treatment():
    """The trial with one unit in eight treated: batches of 8, shuffled, often hold none."""
    x, _, y = M.trial()
    return x, (torch.arange(len(x)) % 8 == 0).float(), y


@pytest.mark.parametrize("mean, scale, rounded", [(40, 15, "in float32"),
                                                  (100, 100, "in float64 too")])
def test_an_untrimmed_propensity_rounded_to_1_asks_for_trimming_not_a_stable_variance(
        tmp_path, mean, scale, rounded):
    """The propensity head of a TARNet is a logistic regression on the raw covariates, one of
    them not standardised (age in years, 40 ± 15): its logit reaches 17.8 for a treated unit
    of the first batch, where sigmoid is 1.0 in float32 (1 − 2e-8 in float64), and the
    inverse propensity weight's ``(1 − t) / (1 − e)`` is 0/0. The op, sample and
    ``precision`` were right, but the hint blamed catastrophic cancellation 'as in a
    variance' and offered torch.var; it now says that the 0 is 1 − sigmoid rounded to 1, and
    that a probability that divides is trimmed (e.clamp(0.01, 0.99)). A covariate of
    100 ± 100 puts logits past 37, where float64 rounds too: the same trim is named there."""
    x, _, y = M.trial()
    x[:, 5] = mean + scale * x[:, 5]
    g = torch.Generator().manual_seed(1)
    t = (torch.rand(len(x), generator=g) < torch.sigmoid((x[:, 5] - mean) / 5)).float()
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_ipw_tarnet", M.ipw_loss, (x, t, y), batch_size=16)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    e = torch.sigmoid(M.make_ipw_tarnet()(x[:16])[2])
    saturated = [i for i in range(16) if e[i] == 1 and t[i] == 1]
    assert saturated == [9] if scale == 15 else len(saturated) > 8, saturated
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"],
            o["samples"]) == (True, "precision", "<loss>", "aten.div", "nan", saturated), \
        json.dumps(rep, indent=1)
    assert o["source"] == f"causal_inference_models.py:{line_of('(1 - e)  # (untrimmed)')}"
    h = rep["hint"]
    assert "1 − y of a y (tanh, sigmoid" in h and f"rounded to 1 {rounded}" in h, h
    assert "inverse propensity weight" in h and "e.clamp(0.01, 0.99)" in h, h
    assert "sigmoid(−z)" in h, h
    assert "variance" not in h, h  # (was: "catastrophic cancellation, as in a variance")


def test_an_ipm_over_a_batch_without_a_treated_unit_names_the_empty_mean(tmp_path):
    """CFRNet's linear MMD takes the mean representation of each arm,
    ``h_rep[t == 1].mean(0)``; a shuffled batch of 8 with no treated unit (one in eight is
    treated) makes it a mean over 0 rows, NaN. The report names that mean in the loss, no
    sample (no row is to blame), and a mean over an empty selection to skip."""
    x, t, y = rare_treatment()
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_cfrnet", M.cfr_loss, (x, t, y), batch_size=8, shuffle=True,
              takes_t=True)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "loss"), err.event
    g = torch.Generator().manual_seed(0)  # (the loader's order: the first batch without one)
    loader = DataLoader(TensorDataset(t), batch_size=8, shuffle=True, generator=g)
    treated = [int(tb.sum()) for (tb,), _ in zip(loader, range(5))]
    assert treated[-1] == 0 and all(treated[:-1]), treated
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"],
            o["samples"]) == (True, "invalid", "<loss>", "aten.mean", "nan", []), rep
    assert o["source"] == f"causal_inference_models.py:{line_of('h_rep[t == 1].mean(0)')}"
    assert "mean over no element" in rep["hint"] and "empty selection" in rep["hint"], rep
    assert "skip such batches" in rep["hint"], rep["hint"]


def test_a_wasserstein_ipm_with_a_bare_sqrt_names_the_coinciding_treated_and_control_units(
        tmp_path):
    """CFRNet's Wasserstein IPM takes distances between treated and control representations;
    cfrnet wraps the root in ``safe_sqrt``, this copy calls ``torch.sqrt``. With binary
    covariates (as IHDP's) a treated unit and a control unit share their covariates, their
    distance is exactly 0 and sqrt's derivative there infinite: a backward event. The report
    names SqrtBackward0 on the IPM's line, the representation's parameters, the batch rows of
    both units of each coinciding pair (not their rows of the treated x control matrix), and
    an eps under the root."""
    x, t, y = M.trial()
    x = (x > 0).float()
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_cfrnet", M.cfr_wass_loss, (x, t, y), batch_size=32,
              takes_t=True)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # the pairs at distance exactly 0 (those rounded below 0 are clamped: no gradient)
    model, xb, tb = M.make_cfrnet(), x[:32], t[:32]
    h = model(xb, tb)[1]
    treated, control = (tb == 1).nonzero().flatten(), (tb == 0).nonzero().flatten()
    zero = (M.pdist2sq(h[treated], h[control]) == 0).nonzero()
    rows = sorted(treated[zero[:, 0]].tolist() + control[zero[:, 1]].tolist())
    assert len(rows) >= 4
    assert (rep["reproduced"], rep["cause"], o["phase"], o["op"], o["samples"]) == (
        True, "invalid", "backward", "SqrtBackward0", rows), json.dumps(rep, indent=1)
    assert o["param"] == "rep.0.weight", o
    assert o["source"] == f"causal_inference_models.py:{line_of('M = torch.sqrt(')}"
    assert "sqrt(x + eps)" in rep["hint"] and "two points coincide" in rep["hint"], rep


def test_healthy_trimmed_and_clipped_runs_with_one_armed_batches_are_not_stopped(tmp_path):
    """DragonNet's targeted regularisation (its propensity clipped as the port clips it), a
    self-normalised IPW TARNet (propensity trimmed at 0.01) and CFRNet with its IPM skipped on
    one-armed batches, trained for 3 epochs on shuffled batches of 8, most of them with no
    treated unit: no event, no bundle."""
    x, t, y = rare_treatment()
    for make, loss_fn, takes_t in (("make_dragonnet", M.tarreg_loss, False),
                                   ("make_ipw_tarnet", M.snipw_loss, False),
                                   ("make_cfrnet", M.cfr_loss_guarded, True)):
        out = tmp_path / make
        arms = train(out, make, loss_fn, (x, t, y), batch_size=8, epochs=3, shuffle=True,
                     takes_t=takes_t)
        assert len(arms) == 48 and arms.count(0) >= 10, arms  # (one-armed batches were seen)
        assert not list(out.glob("*.nan")), make


def test_a_dr_learner_propensity_of_exactly_1_from_a_tree_asks_for_trimming_not_repair(
        tmp_path):
    """A DR-learner's second stage regresses a network on the doubly robust pseudo-outcome
    ``(t - e) / (e * (1 - e)) * (y - mu_t) + mu1 - mu0``, the nuisances cross-fitted by a
    first stage; its gradient-boosted propensity is coarse, and exactly 1 in a pure leaf
    (row 72, treated): 0/0. The op, row and ``invalid`` were right, but the hint called the
    record degenerate ('drop or repair ... an eps there would train toward a made-up
    target'), while trimming the propensity is the estimator's own fix. It now names the
    loss argument, a probability at 1 there, and the trim (e.clamp(0.01, 0.99))."""
    x, t, y = M.trial()
    g = torch.Generator().manual_seed(2)
    mu0 = x[:, 0] + 0.5 * x[:, 2] + 0.3 * torch.randn(len(x), generator=g)
    mu1 = mu0 + 1 + x[:, 1]
    e = torch.sigmoid(1.5 * x[:, 0] + 0.2 * torch.randn(len(x), generator=g))
    e = torch.round(e * 20) / 20  # a tree ensemble's leaves: coarse, 0 or 1 when pure
    edge = ((e == 0) | (e == 1)).nonzero().flatten().tolist()
    assert edge[0] == 72 and t[72] == 1 and e[72] == 1, edge
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_catenet", M.dr_pseudo_outcome_loss, (x, t, y, mu0, mu1, e),
              batch_size=32)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"],
            o["samples"]) == (True, "invalid", "<loss>", "aten.div", "nan", [72 - 64]), rep
    assert o["source"] == f"causal_inference_models.py:{line_of('pseudo = (t - e) /')}"
    h = rep["hint"]
    assert "computed from the batch's data alone" in h, h
    assert "loss_args[5], a probability" in h and "exactly 0 or 1 at sample(s) 8" in h, h
    assert "e.clamp(0.01, 0.99)" in h and "outside the overlap" in h, h
    assert "degenerate" not in h and "made-up target" not in h, h


def test_an_uplift_transformed_outcome_over_a_one_armed_batch_names_the_batch_share(tmp_path):
    """The transformed outcome ``y (t − p) / (p (1 − p))`` with ``p = t.mean()``, the batch's
    treated share: a shuffled batch of 8 without a treated unit has p = 0, and every row is
    0/0. The report names the division, every sample of the batch, and the divisor as one
    0-d statistic of the batch (no row to blame): clamp it or skip such batches."""
    x, t, y = rare_treatment()
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_catenet", M.transformed_outcome_loss, (x, t, y), batch_size=8,
              shuffle=True)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"],
            o["samples"], o["all_samples"]) == (
        True, "invalid", "<loss>", "aten.div", "nan", list(range(8)), True), rep
    assert o["source"] == f"causal_inference_models.py:{line_of('z = y * (t - p) /')}"
    h = rep["hint"]
    assert "one 0-d value for every element" in h and "no row is to blame" in h, h
    assert "skip such batches" in h and "probability" not in h, h
