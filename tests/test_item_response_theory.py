"""End to end on item response theory models (``item_response_theory_models``): the 2PL, 3PL
and 4PL with ``a = exp(log_a)`` and ``c = sigmoid(logit_c)``, a multidimensional 2PL, the
graded response model and VIBO's amortised Gaussian posteriors, trained on per-student batches
of a response matrix with missing responses masked, a hand-written BCE, Adam with weight
decay, a step schedule and gradient clipping. Each planted failure of the domain fires under
the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import item_response_theory_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BCE_LINE = "return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))"


def line_of(text: str) -> str:
    return source_line("item_response_theory_models.py", text)


def train(make: str, loss, out_dir, plant=None, sentinel: bool = False, steps: int = 6,
          record: bool = True, accum: int = 1, bf16: bool = False):
    """Adam with weight decay, a step schedule and clipping at 5, over a DataLoader of 8
    students a batch (one epoch); ``plant(model, y, m)`` sets the bad condition up (a
    calibration's warm start, a student's responses). ``sentinel``: VIBO's encoder is fed the
    responses with the missing ones coded -999, as the raw data file has them."""
    model = getattr(M, make)()
    y, m = M.responses(0, 2 if make.endswith("pl") or "vibo" in make else M.CATEGORIES)
    if plant is not None:
        plant(model, y, m)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    data = torch.utils.data.TensorDataset(torch.arange(M.STUDENTS), y, m)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    torch.manual_seed(1)  # VIBO's reparameterised samples
    # (the partial credit model's -inf category mask reaches its output on purpose)
    allowed = {"allow_inf": [""]} if make == "make_pcm" else {}
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"item_response_theory_models:{make}", **allowed) \
        if record else None
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for k, (ids, yb, mb) in enumerate(loader):
            if k == steps * accum:
                break
            if k % accum == 0:
                opt.zero_grad()
            if make == "make_vibo":
                raw = torch.where(mb.bool(), yb, torch.full_like(yb, -999.0))
                out = model(raw if sentinel else yb, mb)
            else:
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    out = model(ids)
                out = out.float()
            value = loss_fn(out, yb, mb)
            (value / accum).backward()
            losses.append(value.item())
            if k % accum != accum - 1:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model, losses


def fire(make: str, loss, tmp_path, plant=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, plant, **kw)
    return info.value.event, info.value.bundle_path


def perfect_score_warm_start(model, y, m):
    """Student 21 answered every item right; a JML calibration's ability for a perfect score
    diverges, and the warm start copies its last iterate, 20."""
    with torch.no_grad():
        model.theta.weight[21] = 20.0
    y[21] = m[21]


def test_perfect_score_student_names_log_of_one_minus_p_and_the_logits_form(tmp_path):
    """A perfect-score student warm-started at ability 20: sigmoid(20 + ...) is 1.0 in float32,
    so the hand-written BCE's ``(1 - y) * log(1 - p)`` is 0 * -inf, NaN. The replay names the
    log on the BCE line (its second run), the student (row 5 of the third batch), precision
    (float64 keeps 1 - p above 0) and the logits form of the BCE."""
    ev, bundle = fire("make_2pl", M.irt_loss, tmp_path, perfect_score_warm_start)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"], o["line_run"]) == (
        True, "<loss>", "aten.log", "-inf", [5], 2), o
    assert o["source"] == line_of(BCE_LINE), o
    assert rep["cause"] == "precision" and "rounded to 1 in float32" in rep["hint"], rep["hint"]
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]
    assert "logsigmoid(−z)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,also", [("make_3pl", ()), ("make_4pl", ("logit_d",))])
def test_3pl_guessing_saturated_names_the_mix_and_its_product_form(tmp_path, make, also):
    """A 3PL whose guessing logit for item 3 was warm-started at 20 (a calibration that let
    ``c`` run to 1): ``c = sigmoid(20)`` is 1.0 in float32, so ``p = c + (1 - c) * sigmoid(.)``
    is 1 for every student and the BCE's ``log(1 - p)`` is -inf, at the first step. The replay
    names the log in the loss, every sample, precision (float64 keeps 1 - p above 0), and that
    p is the 3PL's mix: log(1 - p) as logsigmoid(-l) + logsigmoid(-z), c bounded below 1.
    The same for a 4PL whose slipping logit is 20 too (``d = 1``, ``p = c + (d - c) * s``)."""
    def saturated(model, y, m):
        with torch.no_grad():
            for name in ("logit_c", *also):
                getattr(model, name)[3] = 20.0
    ev, bundle = fire(make, M.irt_loss, tmp_path, saturated)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "<loss>", "aten.log", "-inf", True), o
    assert o["source"] == line_of(BCE_LINE), o
    assert rep["cause"] == "precision" and "rounded to 1 in float32" in rep["hint"], rep["hint"]
    assert "here y is a mix c + (d − c)·s" in rep["hint"], rep["hint"]
    assert "log(1 − p) = logsigmoid(−l) + logsigmoid(−z)" in rep["hint"], rep["hint"]
    assert "bound c below 1" in rep["hint"], rep["hint"]


def test_discrimination_loaded_unlogged_names_the_exp_and_its_initial_value(tmp_path):
    """An item bank's discrimination copied into ``log_a`` without its log (100): exp
    overflows at the first forward, every student's logit of that item is inf - inf. The
    replay names the exp in the root's forward on its line, overflow, the parameter and its
    range, and that it is the initial value: an initialisation to fix."""
    def unlogged(model, y, m):
        with torch.no_grad():
            model.log_a[7] = 100.0
    ev, bundle = fire("make_2pl", M.irt_loss, tmp_path, unlogged)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "", "aten.exp", "+inf"), o
    assert o["source"] == line_of("a = torch.exp(self.log_a)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "the parameter log_a (in [-0.1734, 100])" in rep["hint"], rep["hint"]
    assert "the optimizer has not updated log_a yet" in rep["hint"], rep["hint"]
    assert "a value copied where its log belongs" in rep["hint"], rep["hint"]


def test_student_with_every_response_missing_names_the_per_student_mean(tmp_path):
    """Student 21 (row 5 of the third batch) has no observed response: the per-student mean
    ``nll.sum(1) / m.sum(1)`` is 0/0. The replay names the division on its line, the student,
    the empty mask row and to filter such students or floor the count; dropping the student
    makes the step finite."""
    def no_responses(model, y, m):
        m[21] = 0
        y[21] = 0
    ev, bundle = fire("make_2pl", M.irt_loss, tmp_path, no_responses)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", [5]), o
    assert o["source"] == line_of("per_student = nll.sum(1) / m.sum(1)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "Sample(s) 5 are empty records" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_empty_student_in_an_accumulated_batch_names_the_micro_batch_and_row(tmp_path):
    """The same student with no observed response under two accumulated batches a step: it
    is row 5 of the second micro-batch of step 1, which the event and the replay name."""
    def no_responses(model, y, m):
        m[21] = 0
        y[21] = 0
    ev, bundle = fire("make_2pl", M.irt_loss, tmp_path, no_responses, steps=3, accum=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (1, "loss", 0), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["op"], o["samples"], o["micro_batch"]) == (
        True, "aten.div", [5], 0), o
    assert "Sample(s) 5 are empty records" in rep["hint"], rep["hint"]


def test_vibo_posterior_std_underflowed_names_the_log_of_the_exp_and_the_log_var(tmp_path):
    """VIBO's logvar head warm-started at -240 (point-estimate abilities to start from): the
    posterior std ``exp(0.5 * logvar)`` is e^-120, 0 in float32, and the KL's
    ``-log(std)`` is +inf for every student at the first step. The replay names the log on the
    KL line, every sample, underflow, and to take the exponent itself (``0.5 * logvar``)."""
    def point_estimates(model, y, m):
        with torch.no_grad():
            model.logvar.bias.fill_(-240.0)
    ev, bundle = fire("make_vibo", M.vibo_loss, tmp_path, point_estimates)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "<loss>", "aten.log", "-inf", True), o
    assert o["source"] == line_of("kl = -torch.log(std) + 0.5 * (std ** 2 + mu ** 2) - 0.5"), o
    assert rep["cause"] == "underflow" and "its input is an exp's result" in rep["hint"], \
        rep["hint"]
    assert "take the exponent itself instead of the log of its exp" in rep["hint"], rep["hint"]


def test_pcm_response_on_a_category_the_item_lacks_names_the_student_and_the_mask(tmp_path):
    """A partial credit model whose items 6..11 are scored 0..2 (category 3 masked to -inf
    before the softmax, under ``allow_inf``); student 21's response to item 9 was entered
    as 3 (a rescored item's old key): the loss's ``gather`` picks that category's -inf, and the
    sum is -inf. The replay names the loss's reduction on its line, the student (row 5 of the
    third batch), invalid, and a target on a masked class as the fault."""
    def rescored(model, y, m):
        y[21, 9] = 3.0
        m[21, 9] = 1.0
    ev, bundle = fire("make_pcm", M.pcm_loss, tmp_path, rescored)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.sum", "-inf", [5]), o
    assert o["source"] == line_of("return -(logp * m).sum() / m.sum()"), o
    assert rep["cause"] == "invalid" and "a target on a masked class" in rep["hint"], rep["hint"]


def test_grm_crossed_thresholds_name_the_log_of_a_negative_category_probability(tmp_path):
    """The graded response model's thresholds as free parameters, one item's initialised in
    reverse (``b_1 > b_2 > b_3``): P(Y >= 1) < P(Y >= 2), so category 1's probability, a
    difference of the cumulative ones, is negative, and the loss's log of it NaN for the
    students who answered that item in category 1. The replay names the log in the loss, those
    students, invalid, and the model's ``aten.sub`` that made the negative output as the place
    to fix (a reparameterisation), not a clamp in the loss."""
    def crossed(model, y, m):
        with torch.no_grad():
            model.thresholds[4] = torch.tensor([1.0, 0.0, -1.0])
    ev, bundle = fire("make_grm", M.grm_loss, tmp_path, crossed)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "nan", [2, 3]), o
    assert o["source"] == line_of("return -(torch.log(picked) * m).sum() / m.sum()"), o
    assert rep["cause"] == "invalid" and "a negative number" in rep["hint"], rep["hint"]
    assert "the model's output, which the model's forward returned, made by aten.sub" \
        in rep["hint"], rep["hint"]
    assert "bound or reparameterize what makes it negative" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,loss,bf16", [
    ("make_2pl", M.irt_loss_eps, False), ("make_3pl", M.irt_loss_eps, False),
    ("make_4pl", M.irt_loss_eps, False), ("make_mirt", M.irt_loss_eps, False),
    ("make_mirt", M.irt_loss_eps, True), ("make_grm_ordered", M.grm_loss, False),
    ("make_pcm", M.pcm_loss, False), ("make_vibo", M.vibo_loss, False)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, loss, bf16):
    """The clamped BCE with the count floored at 1, over a student with every response
    missing and a perfect-score student at ability 20 (the 2PL to 4PL and the multidimensional
    2PL); the graded model with ordered thresholds (softplus gaps, cumsum); the partial credit
    model's ``-inf`` mask of the categories an item does not have, under ``allow_inf``, read by
    ``log_softmax(...).gather`` at observed categories only; VIBO on the
    masked responses; the multidimensional 2PL under bfloat16 autocast: no event, bit-identical weights and losses with and without the
    recorder."""
    def plant(model, y, m):
        if make.endswith("pl") or make == "make_mirt":
            perfect_score_warm_start(model, y, m)
            m[13] = 0
            y[13] = 0
    recorded, losses = train(make, loss, tmp_path, plant, bf16=bf16)
    plain, plain_losses = train(make, loss, tmp_path, plant, record=False, bf16=bf16)
    assert not list(tmp_path.glob("*.nan"))
    assert losses == plain_losses and len(losses) == 6, losses
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_vibo_fed_missing_responses_coded_minus_999_names_the_code_in_the_encoder_input(
        tmp_path):
    """VIBO's encoder given the raw response rows, the missing ones coded -999 as the data
    file has them (the mask beside them, but not applied): each student with a missing
    response gets an ability mean in the thousands, the 2PL's sigmoid rounds to 1 and the
    BCE's ``log(p)`` is -inf, at the first step. The replay names the log on the BCE line for
    those students, the sigmoid's underflow; beyond the log-space advice, the hint names the encoder input holding -999
    exactly where the mask is 0, to be zeroed before the model sees it."""
    ev, bundle = fire("make_vibo", M.vibo_loss, tmp_path, sentinel=True)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [0, 1, 2, 3, 4, 6]), o
    assert o["source"] == line_of(BCE_LINE), o
    assert rep["cause"] == "underflow" and "logsigmoid" in rep["hint"], rep["hint"]
    assert ("But the model input args[0] holds -999 at every entry where args[1] (0/1) is 0"
            in rep["hint"]), rep["hint"]
    assert "zero them before the model sees them (x * mask" in rep["hint"], rep["hint"]
