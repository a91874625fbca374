"""End to end on contextual bandits and off-policy learning (``bandits_ope_models``): a softmax
policy over items trained from logged ``(context, action, reward, propensity)`` tuples with
IPS, self-normalised IPS from logged log-propensities, capped IPS and a doubly robust
objective with a learned reward model; a Plackett-Luce slate policy under off-policy
REINFORCE; a neural LinUCB head whose bonus is ``sqrt(phi^T A^-1 phi)`` over a buffer the loop
keeps by Sherman-Morrison updates; a DataLoader over logged batches, Adam and gradient
clipping. Each planted bug of the domain fires under the recorder and is replayed with the
CLI; the healthy runs raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import contextlib

import bandits_ope_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4
LAST = (STEPS - 1) * M.B  # the first row of the last step's batch


def line_of(text: str) -> str:
    return source_line("bandits_ope_models.py", text)


def call(make: str, model, lf, x, a, r, p):
    """One logged batch through the model and its objective, as each kind of model takes it."""
    if make == "make_slate":
        return lf(model(x, a), r, p)
    if make == "make_linucb":
        return lf(model(x, a), r)
    if make == "make_dr":
        return lf(model(x, a), a, r, p)
    return lf(model(x), a, r, p)


def train(make: str, loss, out_dir, plant=None, record: bool = True, steps: int = STEPS,
          adam=None, kwargs=None, evict_twice: bool = False, accum: int = 1, amp=None):
    """``steps`` logged batches of 16 rounds; ``plant(tensors, LAST)`` edits the logged data
    before the DataLoader reads it. LinUCB's loop adds each batch to its design matrix's
    inverse after the update (and, with ``evict_twice``, evicts the previous batch from its
    window of one batch twice: a downdate of rows no longer in it). With ``accum``, each
    batch is that many micro-batches (DataLoader batches of ``16 / accum``), the loss divided
    by it; ``amp``: the forward under CPU autocast to that dtype. Returns the model."""
    model = getattr(M, make)(**(kwargs or {}))
    data = M.logged(steps * M.B, slate=make == "make_slate")
    if plant is not None:
        plant(data.tensors, LAST)
    opt = torch.optim.Adam(model.parameters(), **(adam or {"lr": 1e-2}))
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"bandits_ope_models:{make}",
                         factory_kwargs=kwargs) if record else None
    seen = []
    with rec if rec is not None else contextlib.nullcontext():
        lf = rec.loss_fn if rec is not None else loss
        for k, (x, a, r, p) in enumerate(M.loader(data, M.B // accum)):
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss_value = call(make, model, lf, x, a, r, p)
            (loss_value / accum).backward()
            if (k + 1) % accum:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            opt.zero_grad()
            if make == "make_linucb":
                model.update_design(x, a)
                seen.append((x, a))
                if evict_twice and len(seen) > 1:
                    model.forget(*seen[-2])  # BUG: the window's eviction runs twice
                    model.forget(*seen[-2])
    return model


def fire(tmp_path, make: str, loss, plant=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, loss, tmp_path, plant, **kw)
    return info.value.event, info.value.bundle_path


HEALTHY = [("make_policy", M.ips_loss), ("make_policy", M.snips_loss),
           ("make_policy", M.clipped_ips_loss), ("make_dr", M.DRLoss()),
           ("make_slate", M.slate_pg_loss), ("make_linucb", M.linucb_loss)]


@pytest.mark.parametrize("make,loss", HEALTHY)
def test_healthy_off_policy_training_raises_nothing_and_is_bit_identical(tmp_path, make, loss):
    """Every objective on clean logs: no event, no bundle, and the same weights (and LinUCB's
    design-matrix inverse) with and without the recorder."""
    plain = train(make, loss, tmp_path / "plain", record=False)
    recorded = train(make, loss, tmp_path / "rec")
    assert not list((tmp_path / "rec").glob("*.nan"))
    for (n, a), (_, b) in zip(plain.state_dict().items(), recorded.state_dict().items()):
        assert torch.equal(a, b), n


def zero_propensity(row: int):
    def plant(tensors, first):
        tensors[3][first + row] = 0.0  # BUG: the logger wrote mu(a|x) = 0 for an action it took
    return plant


def test_ips_of_a_logged_propensity_of_0_names_the_division_on_its_record(tmp_path):
    """IPS's ``pi / mu`` of a logged propensity of 0 is +inf (then NaN times its reward of
    0): a loss event; the replay names the division in the loss, on record 5, invalid, and
    that record's propensity is 0 in it alone (a record to fix or filter where the log is
    made), and dropping it makes the step finite."""
    ev, bundle = fire(tmp_path, "make_policy", M.ips_loss, zero_propensity(5))
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "<loss>", "aten.div", "+inf", [5]), o
    assert o["source"] == line_of("w = action_prob(logits, action) / propensity"), o
    assert rep["cause"] == "invalid" and "by 0" in rep["hint"], rep["hint"]
    assert "loss_args[3] is 0 everywhere in sample(s) 5" in rep["hint"], rep["hint"]
    assert "fix or filter such records" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_doubly_robust_weight_of_a_zero_propensity_is_degenerate_data(tmp_path):
    """The same logging bug under the doubly robust objective (policy and reward model in one
    module, the loss a module taking both outputs): the division in the loss, record 4, its
    divisor computed from the logged data alone."""
    ev, bundle = fire(tmp_path, "make_dr", M.DRLoss(), zero_propensity(4))
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.div", "+inf", [4]), o
    assert rep["cause"] == "invalid" and "computed from the batch's data alone" in rep["hint"]


def test_zero_propensity_under_accumulation_and_bf16_names_the_micro_batch_row(tmp_path):
    """Two micro-batches of 8 per update, the policy's forward under bf16 autocast: the
    record with propensity 0 is row 3 of the second micro-batch. The event and the replay
    name micro-batch 1 and its row 3 (not row 11 of the update), the division, invalid."""
    ev, bundle = fire(tmp_path, "make_policy", M.ips_loss, zero_propensity(M.B // 2 + 3),
                      accum=2, amp=torch.bfloat16)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "<loss>", "aten.div", 1, [3]), o
    assert rep["cause"] == "invalid" and "by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_capped_ips_where_over_a_zero_propensity_is_a_backward_only_nan(tmp_path):
    """Capped IPS "skips" the rows without a propensity with ``torch.where(mu > 0, pi / mu,
    0)``: the forward is finite, but the division's backward at mu = 0 is 0 * inf = NaN. The
    replay names ``DivBackward0`` in the loss on the where's line, record 5, invalid, and to
    make the divisor safe before the op rather than mask its output."""
    ev, bundle = fire(tmp_path, "make_policy", M.clipped_ips_loss, zero_propensity(5))
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "backward", "<loss>", "DivBackward0", [5]), o
    assert o["source"] == line_of("w = torch.where(propensity > 0, pi / propensity"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "make the masked entries' input safe before the op" in rep["hint"], rep["hint"]


def floored_log_propensity(tensors, first):
    tensors[3][:] = tensors[3].log()  # the log stores log mu(a|x)
    tensors[3][first + 5] = -103.3  # BUG: np.log(max(p, 1e-45)) of a propensity lost as 0


def test_snips_from_a_floored_log_propensity_overflows_exp_on_that_record(tmp_path):
    """SNIPS from logged log-propensities, ``w = exp(log pi - log mu)``: a log-propensity
    floored at -103 makes ``exp`` overflow float32 on record 5 (and the ratio of sums NaN).
    The replay names ``aten.exp`` in the loss, +inf, record 5, overflow, and that the record's
    value is out of scale with the others'."""
    ev, bundle = fire(tmp_path, "make_policy", M.snips_log_loss, floored_log_propensity)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "<loss>", "aten.exp", "+inf", [5]), o
    assert o["source"] == line_of("w = torch.exp(torch.log_softmax(logits, 1)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "sample(s) 5 of loss_args[3] reach 103" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def missing_reward(tensors, first):
    tensors[2][first + 9] = float("nan")  # BUG: a reward joined from a click log it is not in


def test_nan_reward_of_a_missing_join_is_an_input_on_its_record(tmp_path):
    """A reward the join left NaN: an input event on the loss's reward argument, record 9,
    blamed on the data, not on the policy."""
    ev, bundle = fire(tmp_path, "make_policy", M.ips_loss, missing_reward)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [9]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["samples"], rep["cause"]) == (
        True, "input", [9], "input"), o
    assert "loss_args[2] (reward) is an argument of the loss" in rep["hint"], rep["hint"]


def test_adam_without_eps_makes_the_never_logged_actions_rows_nan(tmp_path):
    """The reward model's per-action bias (and output rows) are looked up at the logged
    actions only; the others' gradients are exactly 0, and Adam with ``eps=0`` divides their
    ``m = 0`` by ``sqrt(v) = 0``. An optimizer event at step 0; the replay says the update
    made the weights non-finite and to set eps > 0."""
    ev, bundle = fire(tmp_path, "make_dr", M.DRLoss(), adam={"lr": 1e-2, "eps": 0.0})
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]


def test_plackett_luce_running_product_underflow_names_the_log_and_the_loop(tmp_path):
    """A sharp slate policy (temperature 0.01): the logged ranking's probability, kept as a
    running product of its softmax terms over the shrinking candidate set, underflows float32
    to 0 and its log is -inf. The replay names ``aten.log`` in the root module on its line,
    underflow, and that the 0 is a running product of 4 nonzero factors (no ``prod``) whose
    logs to sum (it had said only the general log-space list)."""
    ev, bundle = fire(tmp_path, "make_slate", M.slate_pg_loss, kwargs={"temperature": 0.01})
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "-inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"]) == (
        True, "", "aten.log", "-inf"), o
    assert o["samples"] == ev["samples"] and 8 not in o["samples"], o
    assert o["source"] == line_of("return torch.log(prob)"), o
    assert rep["cause"] == "underflow", rep["cause"]
    assert "a product of 4 nonzero factors kept running in a loop" in rep["hint"], rep["hint"]
    assert "sum the factors' logs" in rep["hint"], rep["hint"]


def test_linucb_bonus_of_an_indefinite_design_inverse_names_the_buffer(tmp_path):
    """The loop evicts each batch from LinUCB's window twice: the second Sherman-Morrison
    downdate removes rows no longer in ``A``, and the kept ``A^-1`` becomes indefinite, so
    ``phi^T A^-1 phi < 0`` and the bonus's sqrt is NaN on those rounds. The replay names
    ``aten.sqrt`` in the root on the bonus's line, its samples, invalid, and (it had said only
    to clamp) that the buffer ``a_inv`` is symmetric and indefinite, to fix its updates."""
    ev, bundle = fire(tmp_path, "make_linucb", M.linucb_loss, evict_twice=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "", "aten.sqrt", "nan", [2, 6, 9, 10, 11, 13, 14]), o
    assert o["samples"] == ev["samples"], (o, ev)
    assert o["source"] == line_of("return mean, mean + self.alpha * width.sqrt()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "the model's buffer 'a_inv' (8 x 8, symmetric), which is indefinite" in rep["hint"]
    assert "Sherman-Morrison downdate" in rep["hint"], rep["hint"]
