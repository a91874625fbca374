"""End to end on matrix factorisation (``matrix_factorization_models``): Poisson / KL NMF by
gradient over a DataLoader of (user, item, count) triples (accumulated, under bfloat16
autocast), full-batch KL-NMF by projected gradient, online NMF whose weights come from
Lee-Seung multiplicative updates in ``no_grad``, the whole matrix by the loop's own
multiplicative updates with no optimizer, ALS-WR's per-user normal equations solved in
forward, a heteroscedastic PMF's softplus noise variance (by hand and through
``torch.distributions``), next-item MF with a seen-items -inf mask, a weighted low-rank
approximation with an observation mask, and Funk-SVD's SGD diverging. Each planted bug of the
domain fires under the recorder and is replayed with the CLI; the healthy versions raise no
event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import matrix_factorization_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("matrix_factorization_models.py", text)


def batches(kind: str, g: torch.Generator, steps: int, bad: int | None, missing=0.0,
            accum: int = 1):
    """(model args, loss args after the model's output) of each step; ``bad`` planted in the
    last step's batch."""
    for step in range(steps):
        plant = bad if step == steps - 1 else None
        if kind == "poisson":
            u, i, v = M.count_triples(g, zero_at=plant)
            # shuffle=False keeps the planted triple's row; a DataLoader, as the loop would;
            # batches of 48 are the accumulated micro-batches of one step (``accum``)
            yield [((bu, bi), (bv,)) for bu, bi, bv in
                   DataLoader(TensorDataset(u, i, v), batch_size=len(u) // accum)]
        elif kind == "coder":
            v = M.documents(g, empty=plant)
            yield (v,), (v,)
        elif kind == "projected":  # the user is silent every week
            v = M.weekly_counts(g, bad)
            yield (torch.arange(M.USERS),), (v,)
        elif kind == "pmf":
            u, i, side, r = M.rated_triples(g, raw_count_at=plant)
            for bu, bi, bs, br in DataLoader(TensorDataset(u, i, side, r), batch_size=32):
                yield (bu, bi, bs), (br,)
        elif kind == "seen":
            u, seen, target = M.next_items(g, leaked=plant)
            yield (u, seen), (target,)
        elif kind == "als":
            r, m = M.rating_matrix(g, cold=plant, missing=missing)
            yield (r, m), (r, m)
        else:
            r, m = M.rating_matrix(g, n=M.USERS, missing=float("nan") if plant is not None
                                   else missing)
            yield (torch.arange(M.USERS),), (r, m)


LOSSES = {"poisson": M.kl_loss, "projected": M.kl_loss_xlogy, "coder": torch.nn.MSELoss(),
          "als": M.als_loss, "pmf": M.gaussian_nll, "seen": torch.nn.CrossEntropyLoss(),
          "low_rank": M.masked_mse}


def train(kind: str, make: str, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, loss=None, missing=0.0, floor: float = 0.0,
          lr: float = 1e-2, sgd: bool = False, accum: int = 1, bf16: bool = False):
    """Adam with gradient clipping and a step schedule (``sgd``: Funk-SVD's plain SGD with
    momentum, neither); the NMF factors projected back onto the non-negative orthant (``floor``
    and up) after each step; ``accum`` micro-batches a step. Returns the model."""
    model = getattr(M, make)()
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if sgd
           else torch.optim.Adam(model.parameters(), lr=lr))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    crit = loss or LOSSES[kind]
    g = torch.Generator().manual_seed(0)
    # (the seen items' -inf scores are intended: allowed in the root's output)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"matrix_factorization_models:{make}",
                         allow_inf=[""] if kind == "seen" else []) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for batch in batches(kind, g, steps, bad, missing, accum):
            opt.zero_grad()
            for args, targets in batch if isinstance(batch, list) else [batch]:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = model(*args)
                loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
                (loss / accum).backward()
            if not sgd:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if not sgd:
                sched.step()
            if kind == "coder":
                with torch.no_grad():
                    model.H.clamp_(min=0.0)
            if kind == "projected":
                model.project(floor)
    return model


def fire(kind: str, make: str, tmp_path, bad: int, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, bad, **kw)
    return info.value.event, info.value.bundle_path


def same_training(kind: str, make: str, tmp_path, bad: int, **kw) -> None:
    """No event, and bit-identical weights with and without the recorder."""
    recorded = train(kind, make, tmp_path, bad, **kw)
    plain = train(kind, make, tmp_path, bad, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bf16", [False, True])
def test_kl_nmf_zero_count_names_the_log_and_the_xlogy_fix(tmp_path, bf16):
    """A count of 0 joined into the click log: the generalised KL loss's ``v log(v / wh)`` is
    0 * log(0) = 0 * -inf = NaN in that triple. The replay names the log's -inf, the mul that
    made the NaN, the triple's row, and xlogy (0 log 0 = 0) as the fix; dropping the row makes
    the step finite. The same with the model's forward under bfloat16 autocast."""
    ev, bundle = fire("poisson", "make_poisson", tmp_path, bad=5, bf16=bf16)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["op"], o["made"], o["samples"]) == (
        True, "loss", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("return (v * torch.log(v / wh) - v + wh).mean()"), o
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid" and "xlogy" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("bf16", [False, True])
def test_kl_nmf_with_xlogy_takes_zero_counts_without_an_event(tmp_path, bf16):
    """xlogy's 0 log 0 = 0 (the rate wh > 0 by softplus): no event, the same training, also
    under bfloat16 autocast."""
    same_training("poisson", "make_poisson", tmp_path, 5, loss=M.kl_loss_xlogy, bf16=bf16)


def test_multiplicative_update_without_eps_names_the_empty_document(tmp_path):
    """An empty document (a zero row of V): Lee-Seung's first update sets its weights to
    0 * x / y = 0, the second divides 0 by ``w H H^T`` = 0. The NaN is made in ``no_grad``
    inside the root's forward; the replay names the division, its line, the document's row,
    the second run of the line, and that the eps added to the denominator was 0."""
    ev, bundle = fire("coder", "make_coder", tmp_path, bad=3)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "", [3], "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=3")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["inputs_finite"]) == (
        "", "aten.div", "nan", [3], True), o
    assert o["source"] == line_of("w = w * (v @ h.T) / (w @ hht + self.eps)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_multiplicative_update_with_eps_keeps_empty_documents_at_zero(tmp_path):
    """sklearn's eps in the denominator: the empty document's weights stay 0, no event, and
    the projected-gradient dictionary trains the same with and without the recorder."""
    same_training("coder", "make_coder_eps", tmp_path, 3)


def test_als_wr_cold_user_names_the_solve_and_the_all_zero_normal_equations(tmp_path):
    """ALS-WR's ridge ``lambda * n_u * I`` is 0 for a user who rated nothing, whose normal
    equations are then 0 x = 0: ``torch.linalg.solve`` raises for that batch element. The
    LinAlgError reaches the loop unchanged, with the bundle in its note; the replay names the
    solve, the user's row, and (where the batch's spectrum would quote other users' singular
    values) that this user's matrix is all zeros, the count-scaled ridge vanishing with it."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        train("als", "make_als", tmp_path, bad=4)
    bundle, = tmp_path.glob("*.nan")
    assert any(str(bundle) in n for n in info.value.__notes__), info.value.__notes__
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        3, True, "", "aten._linalg_solve_ex", [4]), o
    assert o["source"] == line_of("x = torch.linalg.solve(a, b)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert rep["hint"].startswith("aten._linalg_solve_ex: the matrix of sample 4 is all zeros"), \
        rep["hint"]
    assert "lambda * max(n_u, 1)" in rep["hint"], rep["hint"]


def test_als_with_a_constant_ridge_solves_cold_users(tmp_path):
    """The plain ridge ``lambda I``: a cold user's factor is 0, no event, same training."""
    same_training("als", "make_als_ridge", tmp_path, 4)


def test_masked_loss_over_nan_missing_ratings_names_the_mask_product(tmp_path):
    """Ratings pivoted with pandas hold NaN where unobserved; the squared error multiplied by
    the observation mask keeps NaN * 0 = NaN. An input event on the ratings; the replay names
    the mask product and says to fill or select before the loss, not after."""
    ev, bundle = fire("low_rank", "make_low_rank", tmp_path, bad=0)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "input", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["made"], rep["cause"]) == ("input", "nan", "input"), rep
    assert o["source"] == line_of("mask.sum()  # NaN * 0 is NaN"), o
    assert "multiplied the NaN of loss_args[1]" in rep["hint"], rep["hint"]
    assert "torch.where(observed, x, 0)" in rep["hint"], rep["hint"]


def test_nan_missing_ratings_kept_out_by_where_raise_nothing(tmp_path):
    """The same NaN-holding ratings with the error zeroed by ``torch.where`` before it is
    squared: the NaN never leaves the loss's input, its gradient is 0 there, so no event (a
    NaN target the loss keeps out is not a false alarm) and the same training."""
    same_training("low_rank", "make_low_rank", tmp_path, 0, loss=M.masked_mse_where)


def test_projected_kl_nmf_names_xlogys_gradient_at_a_factor_row_projected_to_zero(tmp_path):
    """Full-batch KL-NMF with xlogy (counts of 0 are fine in the forward) by projected
    gradient: a user silent every week has their row of W pushed down and projected onto 0
    exactly by ``clamp_(min=0)`` after the first steps, so ``wh`` is 0 where ``v`` is 0 and
    xlogy's gradient ``v / wh`` is 0/0. A backward event at step 2 with a finite loss; the
    replay names XlogyBackward0 on the user's row and says y must stay off 0 (a projection
    onto [eps, inf)), not the masked-forward advice."""
    ev, bundle = fire("projected", "make_projected", tmp_path, bad=5, lr=0.05)
    assert (ev["step"], ev["phase"], ev["kind"]) == (2, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "backward", "<loss>", "XlogyBackward0", "nan", [5]), o
    assert o["source"] == line_of("torch.xlogy(v, v) - torch.xlogy(v, wh)"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "its gradient for y is x / y, 0/0" in rep["hint"], rep["hint"]
    assert "clamp_(min=eps)" in rep["hint"] and "both branches" not in rep["hint"], rep["hint"]


def test_projected_kl_nmf_with_an_eps_floor_trains_the_silent_user(tmp_path):
    """The projection onto [1e-6, inf): the silent user's rate stays positive, no event, and
    the same training with and without the recorder."""
    same_training("projected", "make_projected", tmp_path, 5, lr=0.05, floor=1e-6)


def test_sgd_on_uncentred_ratings_diverges_and_the_replay_says_so(tmp_path):
    """Funk-SVD-style SGD with momentum at lr 5 on raw 1-5 ratings, unclipped:
    the factors grow step after step until ``U @ V^T`` overflows at step 7 in every user's
    row. The replay names the product and overflow, and (from the recorded history) that the
    run was diverging since step 2, so the fix is the learning rate, not float64."""
    ev, bundle = fire("low_rank", "make_low_rank", tmp_path, bad=None, steps=20, lr=5.0,
                      sgd=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (7, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.mm", list(range(M.USERS)), "overflow"), rep
    assert o["source"] == line_of("return self.U[users] @ self.V.T"), o
    assert "diverging" in rep["hint"] and "lower the learning rate" in rep["hint"], rep["hint"]
    assert rep["precursors"][0]["step"] == 2, rep["precursors"]


def test_pmf_softplus_variance_underflow_names_the_log_and_the_raw_count_record(tmp_path):
    """A record whose popularity feature is the raw view count (2e5, not its standardised
    log): the noise head's ``softplus(w . side)`` is softplus(-2e4), positive in exact
    arithmetic but 0 in float32 (and float64), and the Gaussian NLL's ``log(var)`` is -inf,
    ``(r - mean)^2 / (2 var)`` +inf: NaN. A loss event at step 6 (two DataLoader batches a
    week); the replay names the log on that record, underflow (not a 0 exact arithmetic
    makes), and the record's out-of-scale feature; dropping it makes the step finite."""
    ev, bundle = fire("pmf", "make_pmf", tmp_path, bad=7)
    assert (ev["step"], ev["phase"], ev["kind"]) == (6, "loss", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.log", "-inf", [7], "underflow"), rep
    assert o["source"] == line_of("return (0.5 * torch.log(var) + (r - mean) ** 2"), o
    assert "softplus" in rep["hint"] and "sample(s) 7 of args[2]" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_pmf_with_a_variance_floor_takes_the_raw_count_record(tmp_path):
    """``softplus(...) + 1e-4``: the same record gives a large but finite loss, no event, and
    the same training with and without the recorder."""
    same_training("pmf", "make_pmf_floored", tmp_path, 7)


def lee_seung(out_dir, eps: float, steps: int = 6, record: bool = True):
    """The whole (users x items) matrix, an item no one interacted with (column 6 all 0),
    factorised by the loop's multiplicative updates with no optimizer; ``rec.end_step()``
    after each forward and loss, before the update, as the guide asks of such loops."""
    model = M.make_lee_seung()
    g = torch.Generator().manual_seed(0)
    v = M.weekly_counts(g)
    v[:, 6] = 0.0
    rec = FlightRecorder(model, None, loss_fn=M.frobenius, out_dir=out_dir,
                         factory="matrix_factorization_models:make_lee_seung") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for _ in range(steps):
            wh = model()
            (rec.loss_fn if rec is not None else M.frobenius)(wh, v)
            if rec is not None:
                rec.end_step()
            model.update(v, wh, eps)
    return model


def test_multiplicative_updates_without_eps_name_the_items_column_of_h(tmp_path):
    """The item's column of H is 0 after the first update (its numerator W^T v is 0) and
    0/0 at the second, and W's update, a product with all of H, is then NaN throughout: a
    weights event at step 2. The replay cannot re-run the loop's update; its hint says H is
    non-finite only in column 6, W throughout as a product spreads it, and names the
    multiplicative update's missing eps, not only an EMA's momentum."""
    with pytest.raises(NonFiniteError) as info:
        lee_seung(tmp_path, eps=0.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"], sorted(ev["params"])) == (2, "weights", ["H", "W"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "weights", rep["cause"]
    assert "(H: 4 of 80, whole slices along dim 1: 6), and W non-finite throughout" in \
        rep["hint"], rep["hint"]
    assert "multiplicative update's num / den without an eps" in rep["hint"], rep["hint"]


def test_multiplicative_updates_with_eps_raise_nothing_and_factorise_the_same(tmp_path):
    """sklearn's eps in both denominators: the item's column of H stays 0, no event, and
    the recorder (with its end_step each iteration) leaves the factors bit-identical."""
    recorded = lee_seung(tmp_path, eps=1e-10)
    plain = lee_seung(tmp_path, eps=1e-10, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert torch.equal(recorded.W, plain.W) and torch.equal(recorded.H, plain.H)
    assert bool((recorded.H[:, 6] == 0).all())


def test_kl_nmf_zero_count_in_the_second_accumulated_micro_batch(tmp_path):
    """Two accumulated micro-batches of 48 triples a step; the count of 0 is triple 53, row 5
    of the second: the event and the replay name micro-batch 1 and its row 5, and the
    xlogy fix."""
    ev, bundle = fire("poisson", "make_poisson", tmp_path, bad=53, accum=2)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "aten.log", 1, [5], "invalid"), o
    assert "xlogy" in rep["hint"], rep["hint"]


def test_seen_items_mask_holding_the_target_names_the_user_and_the_disagreement(tmp_path):
    """Next-item prediction over every item, the user's seen items masked to -inf (allowed in
    the output). One user's history was built from the whole log, the held-out next item
    included: its probability is 0 and the cross-entropy +inf. The replay names the NLL on
    that user's row and says the target and the mask disagree (unmask the target), not to
    give masked classes zero weight or use label smoothing."""
    ev, bundle = fire("seen", "make_seen_masked", tmp_path, bad=9)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=9")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.nll_loss_forward", "+inf", [9], "invalid"), rep
    assert "a target on a masked class" in rep["hint"], rep["hint"]
    assert "seen[rows, target] = False" in rep["hint"], rep["hint"]
    assert "label smoothing" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_seen_items_masked_to_minus_inf_under_allow_inf_raise_nothing(tmp_path):
    """The -inf of every seen item stays inside the softmax (no target is seen): no event,
    and the same training with and without the recorder."""
    same_training("seen", "make_seen_masked", tmp_path, None)


def test_pmf_normal_refusing_an_underflowed_scale_is_underflow_of_the_record(tmp_path):
    """The same record through ``torch.distributions.Normal(mean, var.sqrt())``: its check
    refuses the scale 0 (a ValueError, raised as is, with the bundle in its note). softplus
    of -2e4 underflows in float64 too, which the replay read as a value the code gives by
    construction (``invalid``); softplus is never 0, so it is ``underflow``, with the
    record's out-of-scale feature named as for the log above."""
    with pytest.raises(ValueError) as info:
        train("pmf", "make_pmf", tmp_path, bad=7, loss=M.normal_nll)
    bundle, = tmp_path.glob("*.nan")
    assert any(str(bundle) in n for n in info.value.__notes__), info.value.__notes__
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"]) == (
        6, "", "aten.softplus", "0", [7]), o
    assert o["source"] == line_of("var = F.softplus(self.noise(side).squeeze(-1))"), o
    assert rep["cause"] == "underflow", rep["hint"]
    assert "aten.softplus is positive in exact arithmetic" in rep["hint"], rep["hint"]
    assert "sample(s) 7 of args[2] reach 2e+05" in rep["hint"], rep["hint"]


def test_masked_mean_over_a_batch_of_cold_users_names_the_zero_count(tmp_path):
    """Mini-batches of 8 users; at step 3 none of them has rated anything yet (new sign-ups
    in one batch), so the masked mean's ``mask.sum()`` is 0 and the loss is 0/0. The replay
    names the division, blames no row (the divisor is one count for the batch) and gives
    ``clamp_min(1)``."""
    model = M.make_low_rank()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.masked_mse, out_dir=tmp_path,
                            factory="matrix_factorization_models:make_low_rank") as rec:
            for step in range(4):
                r, m = M.rating_matrix(g, n=8)
                if step == 3:
                    m.zero_()
                opt.zero_grad()
                rec.loss_fn(model(torch.arange(8) + 8 * (step % 3)), r, m).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "loss", "aten.div", "nan", [], "invalid"), rep
    assert o["source"] == line_of("mask.sum()  # NaN * 0 is NaN"), o
    assert "no row is to blame" in rep["hint"] and "clamp_min(1)" in rep["hint"], rep["hint"]
