"""End to end on learned cardinality estimation (``cardinality_estimation_models``): MSCN's set
convolutions over a query's tables (with sample bitmaps), joins and predicates, mean-pooled by
their 0/1 masks; a sigmoid output of the min-max normalised log-cardinality, or the
log-cardinality itself warm-started at the training set's mean; the q-error
``max(est / true, true / est)`` of ``exp`` of the prediction (a variant masking queries of an
empty result with ``torch.where``), or an MSE against labels min-max normalised in the loss;
a plan-tree model (tree convolution over a plan's nodes, their estimated rows ``log``'d);
a DataLoader over a TensorDataset, Adam with gradient clipping, float16 autocast, SGD. Each
planted bug of the domain fires under the recorder and is replayed with the CLI; the healthy
runs raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import cardinality_estimation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4
LAST = (STEPS - 1) * M.B  # the first query of the last step's batch
LO, HI = M.label_range(M.queries(STEPS * M.B).tensors[-1])


def line_of(text: str) -> str:
    return source_line("cardinality_estimation_models.py", text)


def train(make: str, loss_fn, out_dir, plant=None, record: bool = True, amp=None,
          lr: float = 1e-3, sgd: bool = False):
    """Four batches of 16 queries; ``plant(tensors, LAST)`` edits the last batch's queries
    before the DataLoader reads them. Adam with the gradient norm clipped at 10 (``sgd``:
    plain SGD, unclipped); ``amp``: the model's forward under CPU autocast. Returns the
    model."""
    model = getattr(M, make)()
    data = M.queries(STEPS * M.B)
    if plant is not None:
        plant(data.tensors, LAST)
    opt = (torch.optim.SGD if sgd else torch.optim.Adam)(model.parameters(), lr=lr)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"cardinality_estimation_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        criterion = rec.loss_fn if rec is not None else loss_fn
        for tables, joins, preds, t_mask, j_mask, p_mask, card in M.loader(data):
            with torch.autocast("cpu", dtype=amp or torch.float16, enabled=amp is not None):
                pred = model(tables, joins, preds, t_mask, j_mask, p_mask)
            loss = criterion(pred, card)
            loss.backward()
            if not sgd:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            opt.zero_grad()
    return model


def fire(make: str, loss_fn, tmp_path, plant=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss_fn, tmp_path, plant, **kw)
    return info.value.event, info.value.bundle_path


def test_healthy_runs_raise_nothing_and_train_bit_identically(tmp_path):
    """Both models, the q-error on the sigmoid's and on the log-space output: no event, no
    bundle, and the weights after four steps equal those of the same loop without it."""
    for make, loss in (("make_mscn", M.QError(LO, HI)),
                       ("make_log_mscn", M.QError(LO, HI, log_space=True))):
        recorded = train(make, loss, tmp_path / make)
        bare = train(make, loss, None, record=False)
        for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
            assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.nan"))


def empty_join_set(tensors, first):
    tensors[4][first + 6] = 0  # BUG: an encoder writing no join slot for a single-table query


def test_empty_join_set_names_the_masked_mean_of_that_query(tmp_path):
    """A single-table query encoded with no join element: the join set's masked mean divides
    its sum by a count of 0 (0/0). The replay names the division in ``joins`` on query 6,
    that its divisor is a count of 0/1 entries, the join mask (args[4]) empty in that query
    alone, and dropping it makes the step finite."""
    ev, bundle = fire("make_mscn", M.QError(LO, HI), tmp_path, empty_join_set)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"], ev["samples"]) == (
        3, "forward", "joins", 0, [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "joins", "aten.div", "nan", [6]), o
    assert o["source"] == line_of("return hid.sum(1) / mask.sum(1)"), o
    assert rep["cause"] == "invalid" and "count of its valid entries" in rep["hint"], rep["hint"]
    assert "Sample(s) 6 are empty records: args[4] (0/1 data)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def zero_cardinality(tensors, first):
    tensors[6][first + 9] = 0  # BUG: a query with an empty result kept in the training set


def test_zero_true_cardinality_names_the_q_error_division(tmp_path):
    """A query whose true cardinality is 0: the q-error's ``est / card`` is +inf for it. The
    replay names that division in the loss, query 9, its divisor the batch's own data."""
    ev, bundle = fire("make_mscn", M.QError(LO, HI), tmp_path, zero_cardinality)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "+inf", [9]), o
    assert o["source"] == line_of("return torch.maximum(est / card, card / est).mean()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]


def test_zero_cardinality_masked_by_where_names_the_backward_division(tmp_path):
    """The same query left out through ``torch.where(card > 0, q, 0)``: the loss is finite,
    but the backward of ``est / card`` is 0 times inf there. The replay names DivBackward0
    at the q-error's line on query 9, and a safe input before the division, not its output."""
    ev, bundle = fire("make_mscn", M.MaskedQError(LO, HI), tmp_path, zero_cardinality)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "backward", "<loss>", "DivBackward0", "nan", [9]), o
    assert o["source"] == line_of("q = torch.maximum(est / card, card / est)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "loss_args[1] is 0 everywhere in sample(s) 9" in rep["hint"], rep["hint"]
    assert "give the op a safe input" in rep["hint"], rep["hint"]


def test_label_range_of_one_value_names_the_loss_attributes(tmp_path):
    """Labels min-max normalised in the loss with a range fitted where min equals max (one
    query template): ``hi - lo`` is the Python number 0 at step 0, every query +inf. The
    replay names the division and the loss's two attributes that are equal, not only a
    setting in general."""
    ev, bundle = fire("make_mscn", M.NormalisedMSE(LO, LO), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "<loss>", "aten.div", "+inf", True), o
    assert o["source"] == line_of("target = (torch.log(card) - self.lo) / (self.hi - self.lo)")
    assert rep["cause"] == "invalid" and "by the number 0" in rep["hint"], rep["hint"]
    assert f"the loss's attributes lo and hi are both {LO:.3g}" in rep["hint"], rep["hint"]
    assert "max(hi - lo, eps)" in rep["hint"], rep["hint"]


def test_float16_exp_of_log_cardinality_is_an_overflow_not_the_labels_scale(tmp_path):
    """The log-space model under float16 autocast: its output (warm-started near 11) leaves
    float16, and ``exp`` of it passes 65504 in every query once Adam moves it past 11.09. The
    replay names ``aten.exp`` in the loss, overflow, float16's range; the true
    cardinalities, spanning decades by design and never read by the exp, are not called out
    of scale (the step without the queries whose cardinalities stand out still overflows)."""
    ev, bundle = fire("make_log_mscn", M.QError(LO, HI, log_space=True), tmp_path,
                      amp=torch.float16, lr=1e-2)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (1, "loss", "<loss>", "+inf")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"], o["dtype"]) == (
        "<loss>", "aten.exp", "+inf", True, "float16"), o
    assert o["source"] == line_of("est = torch.exp(log_est)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "compute this op in float32" in rep["hint"], rep["hint"]
    assert "out of scale" not in rep["hint"], rep["hint"]


def test_unclipped_sgd_on_the_q_error_names_the_divergence(tmp_path):
    """The q-error's gradient grows as ``exp`` of the error: SGD with no clipping throws the
    weights far at step 1, every estimate of step 2 is ``exp`` of a hugely negative number,
    0, and ``card / est`` is +inf. The replay names that division, an underflow, and that the
    weights had jumped: lower the rate or clip."""
    ev, bundle = fire("make_log_mscn", M.QError(LO, HI, log_space=True), tmp_path,
                      lr=0.1, sgd=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "<loss>", "aten.div", "+inf", True), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "the weights had jumped in the update before step 2" in rep["hint"], rep["hint"]
    assert "clip the gradients" in rep["hint"], rep["hint"]


def train_tree(out_dir, plant=None, record: bool = True):
    """The plan-tree model over four batches of 16 plans, the log-space q-error (its range
    fitted on the plans' true cardinalities), Adam. Returns the model."""
    model = M.make_tree()
    data = M.plans(STEPS * M.B)
    if plant is not None:
        plant(data.tensors, LAST)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = M.QError(*M.label_range(data.tensors[-1]), log_space=True)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory="cardinality_estimation_models:make_tree") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        criterion = rec.loss_fn if rec is not None else loss_fn
        for ops, est_rows, children, node_mask, card in M.loader(data):
            criterion(model(ops, est_rows, children, node_mask), card).backward()
            opt.step()
            opt.zero_grad()
    return model


def test_plan_tree_healthy_run_is_unchanged_by_the_recorder(tmp_path):
    recorded, bare = train_tree(tmp_path), train_tree(None, record=False)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.nan"))


def unestimated_node(tensors, first):
    tensors[1][first + 4, 2] = 0  # BUG: a plan node parsed with no row estimate, filled with 0


def test_plan_node_without_row_estimate_names_the_log_of_that_plan(tmp_path):
    """A plan node whose optimizer estimate the parser filled with 0: ``log`` of it is -inf,
    which the tree convolution spreads to NaN. The replay names the log in the root module
    on plan 4 alone, the batch's own 0 there (args[1]) as a bad record, not an eps."""
    with pytest.raises(NonFiniteError) as info:
        train_tree(tmp_path, unestimated_node)
    ev, bundle = info.value.event, info.value.bundle_path
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [4]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.log", "-inf", [4]), o
    assert o["source"] == line_of("torch.log(est_rows).unsqueeze(-1) / 10"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "its input is the batch's own data (args[1]" in rep["hint"], rep["hint"]
    assert "An eps on it would turn the record into a huge finite value" in rep["hint"]
