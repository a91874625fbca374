"""End to end on fairness-aware training of tabular models (``fairness_models``): a
fairness-regularised logistic model under a demographic-parity penalty of per-group positive
rates, with per-group intercepts, under bf16 autocast; Lagrangian equalised-odds constraints
with multipliers updated by projected ascent; online group DRO's exponentiated group weights;
adversarial debiasing through a gradient reversal layer. Batches come from a DataLoader with a
WeightedRandomSampler drawing by inverse group frequency, the group attribute handed to the
loss (and to ``forward``), gradients clipped. Each planted failure of the domain fires under
the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import fairness_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("fairness_models.py", text)


def loader(n: int = 96, batch: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y, group, weights = M.tabular_set(g, n)
    sampler = WeightedRandomSampler(weights, n, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, y, group), batch_size=batch, sampler=sampler)


def train(make: str, crit, out_dir, bad=None, at: int | None = None, steps: int = 4,
          kind: str = "plain", eps: float = 1e-8, record: bool = True):
    """Adam and gradient clipping; ``bad(x, y, group)`` rewrites the batch of step ``at`` (the
    last by default); ``kind``: ``group`` hands the group attribute to ``forward`` too,
    ``adversary`` the label, ``bf16`` runs the forward under bf16 autocast."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"fairness_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, (x, y, group) in enumerate(loader()):
            if step == steps:
                break
            if bad is not None and step == (steps - 1 if at is None else at):
                x, y, group = bad(x.clone(), y.clone(), group.clone())
            opt.zero_grad()
            if kind == "group":
                out = model(x, group)
            elif kind == "adversary":
                out = model(x, y)
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bf16"):
                    out = model(x)
            loss_fn(out, y, group).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if hasattr(crit, "ascend"):
                crit.ascend()
    return model


def fire(*args, code: int = 0, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    ev = info.value.event
    return (ev["step"], ev["phase"]), nanreplay_json(info.value.bundle_path, code=code)


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]


def missing_income(x, y, group):
    x[3, 2] = float("nan")  # a missing value read as NaN
    return x, y, group


def no_minority(x, y, group):
    group[group == 2] = 0  # the sampler drew no member of group 2
    return x, y, group


def income_in_cents(x, y, group):
    x[5, 1] = -3e6  # one record in raw units among standardised ones
    return x, y, group


def test_missing_feature_is_named_as_the_input_at_its_row(tmp_path):
    (step, phase), rep = fire("make_logreg", M.DemographicParityLoss(), tmp_path,
                              bad=missing_income)
    assert (step, phase) == (3, "input")
    assert (rep["reproduced"], rep["origin"]["samples"], rep["cause"]) == (True, [3], "input")


def test_positive_rate_of_a_group_absent_from_the_batch_says_leave_it_out(tmp_path):
    """The demographic-parity penalty's positive rate per group, a masked sum over the batch
    over the group's count: 0/0 for a group the sampler drew no member of. No sample is to
    blame; the hint names the group and says to leave it out of the penalty (a floor of the
    count would make its rate 0 in silence), not fixed class weights of the training set."""
    (step, phase), rep = fire("make_logreg", M.DemographicParityLoss(floor=False), tmp_path,
                              bad=no_minority)
    assert (step, phase) == (3, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.div", "nan", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("return (p[:, None] * mask).sum(0) / (count")
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "group(s) [2]" in hint and "leave the empty groups out" in hint, hint
    assert "fixed class weights" not in hint, hint


def test_true_positive_rate_of_a_group_with_no_positive_under_a_zero_multiplier(tmp_path):
    """Equalised odds' true-positive rate per group, positives of a group over their count:
    group 0 of the first batch has no positive label, 0/0. The Lagrange multipliers start at
    0, and their product with the violations keeps the NaN: the hint names that 0 as a
    coefficient, not a mask whose entries the loss meant to leave out."""
    (step, phase), rep = fire("make_logreg", M.LagrangianLoss(floor=False), tmp_path)
    assert (step, phase) == (0, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.div", "nan", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("tpr = (p[:, None] * positives).sum(0)")
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "group(s) [0]" in hint and "no positive label" in hint, hint
    assert "coefficient of 0" in hint and "mask's 0" not in hint, hint


def test_root_of_squared_parity_gaps_at_zero_init_is_a_backward_pole(tmp_path):
    """Logistic regression started at zero weights: every group's rate is 0.5, the gaps are
    exactly 0, and ``sqrt`` of their sum of squares has an infinite derivative there: the
    forward is finite, the backward's SqrtBackward0 makes the NaN at step 0."""
    (step, phase), rep = fire("make_logreg_zero", M.DemographicParityLoss(sqrt_gap=True),
                              tmp_path)
    assert (step, phase) == (0, "backward")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "backward", "<loss>", "SqrtBackward0"), o
    assert o["source"] == line_of("penalty = torch.sqrt((gaps ** 2).sum())"), o
    assert rep["cause"] == "invalid", rep
    assert "vector_norm" in rep["hint"], rep["hint"]


def test_group_dro_weights_with_a_large_step_size_overflow_exp(tmp_path):
    """Group DRO's ``q * exp(eta * group_loss)`` with eta = 200: exp overflows at step 0. The
    binary labels (rows of 1 above rows of 0) are no data out of scale."""
    (step, phase), rep = fire("make_logreg", M.GroupDROLoss(eta=200.0), tmp_path)
    assert (step, phase) == (0, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.exp", "+inf", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("q = self.q * torch.exp(self.eta")
    assert rep["cause"] == "overflow", rep
    assert "out of scale" not in rep["hint"], rep["hint"]


def test_group_dro_weights_overflow_on_a_record_in_raw_units_names_it(tmp_path):
    """At the usual eta = 0.01 a record whose feature is in raw units (-3e6 among standardised
    values) gives its group a loss whose exp overflows: the hint names that sample."""
    (step, phase), rep = fire("make_logreg", M.GroupDROLoss(eta=0.01), tmp_path,
                              bad=income_in_cents)
    assert (step, phase) == (3, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.exp", "+inf", []), rep["origin"]
    assert rep["cause"] == "overflow", rep
    assert "sample(s) 5 of batch" in rep["hint"] and "out of scale" in rep["hint"]


def test_adam_without_eps_on_the_intercept_of_an_absent_group_is_the_optimizer(tmp_path):
    """Per-group intercepts under Adam with eps=0: group 2 is absent from the first batch, its
    intercept's gradient is exactly 0, and the update 0/0 makes it NaN (not re-run: the
    bundle holds the weights after the update, exit 1)."""
    (step, phase), rep = fire("make_group_logreg", M.DemographicParityLoss(), tmp_path,
                              bad=no_minority, at=0, kind="group", eps=0.0, code=1)
    assert (step, phase) == (0, "optimizer")
    assert (rep["reproduced"], rep["cause"]) == (False, "optimizer"), rep
    assert "group_bias" in rep["hint"] and "eps > 0" in rep["hint"], rep["hint"]


def test_confident_adversary_under_log_of_softmax_names_the_underflow(tmp_path):
    """The adversary's cross-entropy on the group written ``log(softmax(adv))``: a confident
    adversary's probability of the true group underflows to 0 in some rows."""
    (step, phase), rep = fire("make_debiaser_confident", M.AdversaryLoss(stable=False),
                              tmp_path, kind="adversary")
    assert (step, phase) == (0, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.log", "-inf",
                              [3, 4, 5, 7, 9, 10, 12, 13, 14]), rep["origin"]
    assert rep["cause"] == "underflow", rep
    assert "log_softmax" in rep["hint"], rep["hint"]


def test_bce_written_out_in_bf16_names_the_rounded_complement(tmp_path):
    """A confident model under bf16 autocast, its cross-entropy written ``log(1 - p)`` on
    ``sigmoid`` probabilities: p rounds to 1 in bf16 at a row whose label is 0."""
    (step, phase), rep = fire("make_logreg_confident", M.ManualParityLoss(), tmp_path,
                              kind="bf16")
    assert (step, phase) == (0, "loss")
    assert origin_of(rep) == (True, "<loss>", "aten.log", "-inf", [1]), rep["origin"]
    assert rep["origin"]["source"] == line_of("task = -(y * torch.log(p) + (1 - y)")
    assert rep["cause"] == "precision", rep
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,crit,kind", [
    ("make_logreg", lambda: M.DemographicParityLoss(), "bf16"),
    ("make_logreg", lambda: M.LagrangianLoss(), "plain"),
    ("make_logreg", lambda: M.GroupDROLoss(), "plain"),
    ("make_group_logreg", lambda: M.DemographicParityLoss(), "group"),
    ("make_debiaser", lambda: M.AdversaryLoss(), "adversary"),
])
def test_healthy_runs_raise_nothing_and_train_bit_identically(tmp_path, make, crit, kind):
    recorded = train(make, crit(), tmp_path, steps=6, kind=kind)
    plain = train(make, crit(), tmp_path, steps=6, kind=kind, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
