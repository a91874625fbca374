"""End to end on ordinal regression (``ordinal_regression_models``): a cumulative-link
(proportional-odds) model with ±inf-padded thresholds, CORAL and CORN heads, DLDL's Gaussian
label distribution with inverse-frequency class weights, NIMA's EMD on score CDFs. Each
planted bug of the domain (thresholds that cross, a label of -1 from an off-by-one scale, an
extreme logit whose interval probability underflows, a grade absent from the training set, a
CORN task with an empty subset, the EMD's sqrt at a perfect prediction) fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import ordinal_regression_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("ordinal_regression_models.py", text)


def batches(steps: int, mild_only_until: int = 0, drop_grade: int | None = None,
            hist: bool = False):
    """``steps`` batches of 32 records; the first ``mild_only_until`` from a clinic with no
    grade above 2; ``drop_grade``: no record of that grade but in the last batch."""
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        x, y = M.ratings(g, mild_only=s < mild_only_until)
        if drop_grade is not None and s < steps - 1:
            x, y = x[y != drop_grade], y[y != drop_grade]
        out.append((x, M.one_hot_hist(y) if hist else y))
    return out


def train(make: str, crit, data, out_dir=None, lr: float = 3e-3, record: bool = True):
    """AdamW with a cosine schedule and gradient clipping, as ordinal-regression repos train
    (coral-pytorch's tutorials, spacecutter); returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(data) + 1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"ordinal_regression_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for x, y in data:
            out = model(x)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, crit, data, tmp_path, lr: float = 3e-3):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, data, tmp_path, lr)
    return info.value.event, info.value.bundle_path


def test_crossed_thresholds_name_the_log_the_grade_and_the_ordering(tmp_path):
    """Unconstrained thresholds, while grade 2 is absent from the batches: the loss pulls
    t_1 and t_2 together until they cross, and the first batch holding grade-2 records takes
    the log of sigmoid(t_2 - f) - sigmoid(t_1 - f) < 0. The replay names the log, its line,
    exactly the grade-2 records, and says the cut-points are out of order (ordered by
    construction is the fix, not a clamp)."""
    data = batches(30, drop_grade=2)
    ev, bundle = fire("make_cumlink_raw", M.cumulative_link_loss, data, tmp_path, lr=0.05)
    assert (ev["step"], ev["phase"], ev["kind"]) == (29, "loss", "nan"), ev
    grade2 = torch.nonzero(data[-1][1] == 2).flatten().tolist()
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.log", "nan", grade2), o
    assert o["source"] == line_of("return -torch.log(p).mean()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "sigmoid(a) - sigmoid(b)" in rep["hint"] and "out of order" in rep["hint"], rep["hint"]
    assert "cumsum(softplus(deltas))" in rep["hint"], rep["hint"]
    assert line_of("p = torch.sigmoid(upper - f)") in rep["hint"], rep["hint"]


def test_ordered_thresholds_under_the_same_batches_raise_nothing(tmp_path):
    """The same run with thresholds ordered by construction (cumsum of softplus gaps): no
    event, and the ±inf pads of the thresholds never alarm."""
    train("make_cumlink", M.cumulative_link_loss, batches(30, drop_grade=2), tmp_path, lr=0.05)
    assert not list(tmp_path.glob("*.nan"))


def off_by_one(data, row: int):
    x, y = data[-1]
    y = y.clone()
    y[row] = -1  # a 1..5 star rating shifted by one twice: its 1-star record is -1
    return [*data[:-1], (x, y)]


def test_label_of_minus_one_names_the_negative_index_not_a_clamp(tmp_path):
    """A label of -1 picks t[-1] = +inf, the pad past the last threshold: P = 0 - 1 under
    the log. The replay names the log and record 6, and leads the hint with the index op
    given -1 (its line), the labels to map to 0..K-1; dropping the record makes it finite."""
    ev, bundle = fire("make_cumlink", M.cumulative_link_loss, off_by_one(batches(4), 6),
                      tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "nan", [6]), o
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert hint.startswith(f"aten.index at {line_of('upper, lower = t[y + 1], t[y]')} was "
                           "given a negative index (-1) in row(s) [6]"), hint
    assert "0..K-1" in hint and "crossed" not in hint, hint
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_extreme_logit_underflows_the_interval_probability(tmp_path):
    """A lab value in the wrong unit (1500 among values of about 1) gives record 9 a logit
    of about 150; its grade-2 probability sigmoid(t_2 - f) - sigmoid(t_1 - f) is 0 in
    float32 (both terms underflow), 1e-101 in float64. The replay says underflow, on record 9,
    with log-space advice and the record's out-of-scale data."""
    data = batches(4)
    x, y = data[-1]
    x, y = x.clone(), y.clone()
    x[9, :3], y[9] = 1500.0, 2
    ev, bundle = fire("make_cumlink", M.cumulative_link_loss, [*data[:-1], (x, y)], tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=9")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [9]), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "log space" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_grade_absent_from_training_set_names_the_class_weight(tmp_path):
    """Inverse-frequency class weights from a training set with no grade-0 record: the
    weight of grade 0 is 1/0, and DLDL's Gaussian label distribution gives grade 0 a positive
    target for every record, so the loss is inf at the first step. The replay names the
    product that took the loss's buffer (not the sum over classes after it), every record,
    the buffer's entry 0, and sends the fix to where the weights are made."""
    data = batches(3)
    crit = M.WeightedSoftOrdinalCE(torch.cat([y for _, y in data]).clamp(min=1))
    ev, bundle = fire("make_softmax", crit, data, tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.mul", "+inf", list(range(32))), o
    assert o["source"] == line_of("return -(self.class_weight * q"), o
    assert rep["cause"] == "weights", rep["cause"]
    hint = rep["hint"]
    assert "'class_weight' holding inf at index 0" in hint and "count.clamp_min(1)" in hint, hint


def test_corn_task_with_an_empty_subset_names_the_mean_over_nothing(tmp_path):
    """CORN re-implemented with each task's mean BCE over its conditional subset: a batch
    from the mild-cases clinic has no record above grade 2, task 3's subset (y > 2) is empty
    and its mean is 0/0. The replay names the BCE on its line, no record, and the empty
    selection."""
    data = batches(3) + batches(4, mild_only_until=4)[3:]
    ev, bundle = fire("make_coral", M.corn_loss_unguarded, data, tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"]) == ("aten.binary_cross_entropy_with_logits", []), o
    assert o["source"] == line_of("losses.append(F.binary_cross_entropy_with_logits"), o
    assert rep["cause"] == "invalid" and "empty" in rep["hint"], rep["hint"]


def test_emd_sqrt_at_a_perfect_prediction_names_the_sqrt_backward(tmp_path):
    """NIMA's EMD with r = 2 takes sqrt of the mean squared CDF difference: a record whose
    out-of-scale features saturate the softmax onto its own grade has a difference of exactly
    0, and sqrt's derivative there is 1/0. A backward event; the replay names SqrtBackward0
    in the loss on record 4 and the eps to add."""
    data = batches(4, hist=True)
    x, h = data[-1]
    x, h = x.clone(), h.clone()
    x[4, :3] = 5000.0  # saturates the softmax onto grade 0 (its exp underflows elsewhere)
    h[4] = M.one_hot_hist(torch.tensor(0))
    ev, bundle = fire("make_softmax", M.emd_loss, [*data[:-1], (x, h)], tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "SqrtBackward0", [4]), o
    assert o["source"] == line_of("return torch.sqrt(torch.mean((cdf_p - cdf_t) ** 2, -1))"), o
    assert rep["cause"] == "invalid" and "sqrt(x + eps)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,crit,hist", [
    ("make_cumlink", M.cumulative_link_loss, False), ("make_coral", M.coral_loss, False),
    ("make_coral", M.corn_loss, False), ("make_softmax", M.emd_loss, True)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, crit, hist):
    """The ±inf-padded cumulative link, CORAL, coral-pytorch's guarded CORN (with batches
    whose top tasks have empty subsets) and NIMA's EMD: no event, bit-identical weights with
    and without the recorder (dropout draws included)."""
    data = batches(4, mild_only_until=2, hist=hist)
    recorded = train(make, crit, data, tmp_path)
    plain = train(make, crit, data, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_smoothed_labels_over_log_of_softmax_name_the_underflow_not_the_zero_weight(tmp_path):
    """Triangular ordinal label smoothing against ``log(softmax)``: record 5's out-of-scale
    features push its softmax to 0 at grades the kernel gives weight 0, and 0 * -inf is the
    loss's NaN. The replay names the log's -inf made by underflow on record 5 (not the
    product with the zero weight), with log_softmax as the fix."""
    data = batches(4)
    x, y = data[-1]
    x = x.clone()
    x[5, :3] = 3000.0
    ev, bundle = fire("make_softmax", M.triangular_smoothed_ce, [*data[:-1], (x, y)], tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"]) == ("aten.log", "-inf", [5]), o
    assert o["source"] == line_of("return -(q * torch.log(logits.softmax(-1)))"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "log_softmax instead of log(softmax)" in rep["hint"], rep["hint"]


def train_loader(out_dir=None, record: bool = True):
    """CORAL from a DataLoader (shuffled with its own generator) under bfloat16 autocast,
    two micro-batches accumulated per update, as coral-pytorch's image examples train."""
    x, y = (torch.cat(t) for t in zip(*batches(4, mild_only_until=2)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    model = M.make_coral()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.coral_loss, out_dir=out_dir,
                         factory="ordinal_regression_models:make_coral") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.coral_loss
        for i, (xb, yb) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xb), yb) / 2
            loss.backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    return model


def test_coral_under_bf16_autocast_with_accumulation_trains_the_same(tmp_path):
    """No event, and the recorder changes nothing the run computes: bit-identical weights
    with and without it, under autocast and accumulation."""
    recorded = train_loader(tmp_path)
    plain = train_loader(record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_label_of_minus_one_inside_forward_names_the_negative_index(tmp_path):
    """The same off-by-one label given to a model whose ``forward(x, y)`` returns each
    record's negative log-likelihood: a forward event on record 6, the log on its line, and
    the hint led by the index op given -1 (not crossed thresholds: they are ordered)."""
    data = off_by_one(batches(4), 6)
    model = M.make_cumlink_nll()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, out_dir=tmp_path, factory="ordinal_regression_models:make_cumlink_nll"):
        for x, y in data:
            loss = model(x, y).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [6]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("", "aten.log", [6]), o
    assert o["source"] == line_of("        return -torch.log(p)"), o  # (forward's)
    hint = rep["hint"]
    assert hint.startswith(f"aten.index at {line_of('p = torch.sigmoid(t[y + 1] - f)')} was "
                           "given a negative index (-1) in row(s) [6]"), hint
    assert "crossed" not in hint, hint
