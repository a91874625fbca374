"""End to end on differentiable optimisation layers (``differentiable_optimization_layers_models``):
an OptNet-style QP solved in forward by an unrolled log-barrier interior-point method (autograd
through the Newton steps), an equality-constrained QP whose custom ``autograd.Function``
differentiates the KKT conditions implicitly (``torch.linalg.solve`` of the KKT matrix in
backward), and a sparsemax attention head over ``-inf``-padded candidate sets. Each planted bug
of the domain fires under the recorder and is replayed with the CLI; the healthy versions
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import differentiable_optimization_layers_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("differentiable_optimization_layers_models.py", text)


def batch(kind: str, g: torch.Generator, bad: int | None):
    """(model args, loss args after the model's outputs) of one step."""
    if kind == "qp":
        feats, lo, hi, budget, target = M.qp_batch(g, tight=bad)
        return (feats, lo, hi, budget), (target,)
    if kind == "roomy":
        feats, lo, hi, budget, target = M.roomy_batch(g)
        return (feats, lo, hi, budget), (target,)
    if kind == "kkt":
        feats, A, b, target = M.kkt_batch(g, empty=bad)
        return (feats, A, b), (target,)
    if kind == "dfl":
        feats, cost, best = M.decision_batch(g, out_of_stock=bad)
        return (feats,), (cost, best)
    if kind == "lowrank":
        feats, target = M.allocation_batch(g)
        return (feats,), (target,)
    if kind == "stock":
        feats, cost, available, best = M.availability_batch(g, out_of_stock=bad)
        return (feats,), (cost, available, best)
    query, cands, mask, y = M.candidate_batch(g)
    return (query, cands, mask), (y,)


LOSSES = {"qp": M.qp_loss, "roomy": M.qp_loss, "sparsemax": M.sparse_loss, "dfl": M.regret,
          "stock": M.masked_regret}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True):
    """Adam with a step schedule and gradient clipping, as OptNet's and cvxpylayers' examples
    train; the sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    crit = LOSSES.get(kind, torch.nn.MSELoss())
    g = torch.Generator().manual_seed(0)
    factory = f"differentiable_optimization_layers_models:{make}"
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=factory) if record else None
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


def fire(kind: str, make: str, tmp_path, bad: int | None):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad)
    return info.value.event, info.value.bundle_path


def test_kkt_backward_of_an_empty_constraint_names_the_solve_and_the_record(tmp_path):
    """A record whose sector lost all its assets to a filter, its sector row of ``A`` all zeros
    (a constraint list built per record without dropping empty rows): the forward solves a
    regularised KKT system (a ``-delta I`` corner, as OSQP does) and is fine, but OptNet's
    implicit backward solves the exact KKT matrix ``[[Q, A^T], [A, 0]]``, singular for that
    record, and ``torch.linalg.solve`` raises in the custom Function's backward, which the
    engine runs outside any module call. The recorder writes the bundle and lets the user's
    LinAlgError through; the replay re-runs the backward, names the solve on its line in the
    backward of the root's Function, record 3 only, singular in exact arithmetic (invalid),
    with the zero row in the hint; dropping the record makes the step finite."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train("kkt", "make_kkt", tmp_path, bad=3)
    bundles = sorted(tmp_path.glob("*.nan"))
    assert len(bundles) == 1, bundles
    notes = getattr(info.value, "__notes__", [])
    assert any(n.startswith("nanreplay: a matrix decomposition failed at step 3 ")
               for n in notes), notes
    rep = nanreplay_json(bundles[0], "--try", "drop=3")
    # (the recorder's event, in the bundle's header: raised by the Function's backward)
    assert (rep["event"]["step"], rep["event"]["phase"]) == (3, "backward"), rep["event"]
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "backward", "", "aten._linalg_solve_ex", [3]), o
    assert o["source"] == line_of("d = torch.linalg.solve(K, rhs)"), o
    assert rep["cause"] == "invalid" and "a zero or duplicated row" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_learned_low_rank_q_without_ridge_names_the_cholesky_as_singular(tmp_path):
    """``Q = L L^T`` with a rank-3 factor of an 8x8 problem and the ridge dropped: singular
    from the first step (float32's rounding leaves a pivot <= 0). The recorder writes the
    bundle of step 0 and lets the LinAlgError through; the replay names the cholesky in the
    root's forward, not positive-definite in exact arithmetic too (invalid), a ridge the fix."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train("lowrank", "make_lowrank_no_ridge", tmp_path)
    bundles = sorted(tmp_path.glob("*.nan"))
    assert len(bundles) == 1 and bundles[0].name.startswith("step00000000"), bundles
    assert any("a matrix decomposition failed at step 0" in n
               for n in getattr(info.value, "__notes__", [])), info.value
    rep = nanreplay_json(bundles[0])
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "forward", "", "aten.linalg_cholesky_ex"), o
    assert o["source"] == line_of("C = torch.linalg.cholesky(Q)"), o
    assert rep["cause"] == "invalid" and "not positive-definite in exact arithmetic" \
        in rep["hint"] and "add a ridge to the diagonal" in rep["hint"], rep["hint"]


def test_infeasible_barrier_start_names_the_slack_reciprocal_and_the_record(tmp_path):
    """A record whose budget was cut below the box's centre: the barrier method's start
    violates the budget row (slack < 0), the fraction-to-the-boundary rule then steps on
    the wrong side of it, and a few Newton steps later the slack rounds to 0 and ``1 / s``
    is +inf in the Newton gradient. The recorder stops the root's forward on that record;
    the replay names the reciprocal on the Newton step's line, at its 7th run, record 5
    alone, and dropping the record makes the step finite."""
    ev, bundle = fire("qp", "make_qp", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["line_run"]) == (
        "", "aten.reciprocal", "+inf", [5], 7), o
    assert o["source"] == line_of("grad = t * (z @ Q + p) + (1 / s) @ self.G"), o
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_duality_gap_below_float32_names_the_slack_pole_as_precision(tmp_path):
    """A duality gap asked 'as small as possible' (1e-40: 41 rounds of t *= 10): long before
    t itself overflows, the active constraints' slacks (about 1 / t) fall below float32's
    resolution of ``h - G z`` and one rounds to 0, so ``1 / s`` is +inf at the first step.
    The replay names the reciprocal on the Newton line, in every record, and precision (the
    float64 re-run keeps the slack positive), with a stable formula or a clamp as the fix."""
    ev, bundle = fire("qp", "make_qp_tight_gap", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.reciprocal", "+inf", True), o
    assert o["source"] == line_of("grad = t * (z @ Q + p) + (1 / s) @ self.G"), o
    assert rep["cause"] == "precision" and "float64 has" in rep["hint"], rep["hint"]


def test_infinite_cost_of_an_unavailable_item_is_named_as_the_records_loss_input(tmp_path):
    """Decision-focused learning: an out-of-stock item priced ``inf`` in the true costs so
    that no decision takes it. The regret ``(cost * z).sum(1)`` would be inf * 0 = NaN or
    +inf; the recorder stops at the loss's input already, names that argument and record 6,
    and the replay says it is the loss's data, not the model's; dropping it is finite."""
    ev, bundle = fire("dfl", "make_pgd", tmp_path, bad=6)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["kind"], ev["samples"]) == (
        3, "input", "loss_args[1]", "+inf", [6]), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [6]), rep["origin"]
    assert "loss_args[1] (true_cost)" in rep["hint"] and "data pipeline" in rep["hint"], \
        rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_priced_out_item_the_decision_takes_names_the_regret_sum_and_the_mask(tmp_path):
    """The same regret pricing unavailable items out inside the loss
    (``masked_fill(~available, inf)``) while the unrolled projected-gradient decision, which
    never sees availability, puts weight on record 6's missing item: +inf regret. The replay
    names the sum on the regret's line, the intentional fill before it in the chain, record
    6, and advises zero weight on masked entries or a large finite value instead of inf."""
    ev, bundle = fire("stock", "make_pgd", tmp_path, bad=6)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=6")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "loss", "<loss>", "aten.sum", [6]), o
    assert o["source"] == line_of("return ((cost * z).sum(1) - best).mean()"), o
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == [
        ("aten.masked_fill", True), ("aten.sum", False)], o["chain"]
    assert rep["cause"] == "invalid" and "zero weight" in rep["hint"] \
        and "large finite" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_barrier_parameter_past_float32_names_the_product_with_t_not_the_clamped_step(tmp_path):
    """The same tiny duality gap on roomy boxes, where no constraint is active and the slacks
    stay of order 1: t *= 10 for 41 rounds reaches 1e39, beyond float32, and ``t * (z @ Q +
    p)`` is inf * 0 = NaN where the gradient is 0. Rounds before that the fraction-to-the-
    boundary ratio ``s / Gdz`` overflowed as the Newton steps shrank, and the clamp took it
    back to a step of 1 every time, as exact arithmetic does: the replay names the mul with
    t on the Newton line, not that clamped division, overflow of the number 1e39, and says to
    cap t or stop at a gap float32 resolves."""
    ev, bundle = fire("roomy", "make_qp_tight_gap", tmp_path, bad=None)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == (
        "", "aten.mul", "nan", True), o
    assert o["source"] == line_of("grad = t * (z @ Q + p) + (1 / s) @ self.G"), o
    assert [c["op"] for c in o["chain"]] == ["aten.mul"], o["chain"]
    assert rep["cause"] == "overflow" and "given the number 1e+39" in rep["hint"] \
        and "t *= mu" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make", [("qp", "make_qp"), ("roomy", "make_qp"), ("kkt", "make_kkt"),
                                       ("sparsemax", "make_sparsemax"), ("dfl", "make_pgd"),
                                       ("stock", "make_pgd"), ("lowrank", "make_lowrank")])
def test_healthy_layers_raise_nothing_and_train_the_same(tmp_path, kind, make):
    """The barrier QP (autograd through 28 unrolled Newton steps, a +inf ratio filled where a
    step moves away from a constraint), the implicit KKT backward on non-empty constraints,
    sparsemax over -inf padding (the sort and cumsum carry -inf inside, the clamp takes the
    padding to 0), and decision-focused learning through 20 unrolled projected-gradient steps
    onto the simplex (its regret, plain and with an availability mask that masks nothing),
    and the low-rank Q with its ridge: no event, bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path)
    plain = train(kind, make, tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
