"""End to end on neural combinatorial optimisation (``combinatorial_optimization_models``):
POMO on TSP and CVRP, trained as POMO's trainer does (Adam with weight decay, a MultiStepLR,
REINFORCE against the shared baseline of the instance's rollouts), with the rollouts' masks of
visited and over-capacity nodes set to -inf before the softmax and next nodes drawn by
``multinomial`` from the global RNG. Each planted bug of the domain fires under the recorder
and is replayed with the CLI; the healthy runs raise no event though their masks put -inf in
every decoding step, and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import combinatorial_optimization_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

LOSSES = {"make_tsp_entropy": M.pomo_entropy_loss}


def line_of(text: str) -> str:
    return source_line("combinatorial_optimization_models.py", text)


def train(make: str, out_dir, bad: int | None = None, steps: int = 4, record: bool = True,
          normalize: bool = False, amp: bool = False):
    """POMO's training loop (the rollouts under bfloat16 autocast with ``amp``); the instance
    ``bad`` is planted in the last step's batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [3], gamma=0.1)
    crit = LOSSES.get(make, M.pomo_loss)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)  # (the rollouts' multinomial draws)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"combinatorial_optimization_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            plant = bad if step == steps - 1 else None
            if make.startswith("make_tsp"):
                args = (M.tsp_batch(g, stacked=plant),)
            else:
                args = M.cvrp_batch(g, raw=plant)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = model(*args)
            loss = loss_fn(*out) if crit is not M.pomo_loss else loss_fn(*out,
                                                                          normalize=normalize)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def assert_fully_masked_row(rep: dict):
    o = rep["origin"]
    assert (rep["reproduced"], rep["event"]["step"]) == (True, 3), rep["event"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "forward", "decoder", "aten._softmax", "nan", [2]), o
    assert o["source"] == line_of("out = (score.softmax(-1) @ self.v)"), o
    # the chain starts in the decoder, at the softmax of the -inf its ``ninf_mask`` argument
    # brought in (a mask, read as intended: the caller's write of it is no start)
    first = o["chain"][0]
    assert (first["op"], first["made"], first["input_min"], first["intentional"]) == (
        "aten._softmax", "nan", "-inf", False), first
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_cvrp_undivided_demands_mask_every_node_and_multinomial_raises(tmp_path):
    """Instance 2's demands came in undivided by the capacity: back at the depot (closed right
    after a visit) every unserved customer exceeds the load, the row of the mask is all -inf
    and the softmax NaN, so ``multinomial`` raises inside the forward, as POMO users see it.
    The recorder still writes the step's bundle (its statistics saw the NaN); the replay names
    the attention's softmax in the decoder, the instance, and a fully masked row. (Its chain
    showed the caller's write of the mask's -inf first while a call given a mask counted as
    one given an infinity; the decoder's ``ninf_mask`` parameter is a mask, and its chain
    starts at the softmax.)"""
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        train("make_cvrp", tmp_path, bad=2)
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    assert (rep["event"]["step"], rep["event"]["phase"]) == (3, "forward"), rep["event"]
    assert_fully_masked_row(rep)


def test_cvrp_greedy_rollout_of_undivided_demands_names_the_instance(tmp_path):
    """The same data under greedy decoding (``argmax`` takes the NaN row on): a forward event
    on instance 2 at step 3, and the same report. Dropping the instance makes the step finite:
    its demands ``(B, N)``, in a batch of as many instances as customers, are cut by row only
    (they were read as a pairwise ``(B, B)`` matrix and cut by column too, and the re-run
    failed on shapes)."""
    with pytest.raises(NonFiniteError) as info:
        train("make_cvrp_greedy", tmp_path, bad=2)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (3, "forward", "nan", [2]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=2")
    assert_fully_masked_row(rep)
    (tried,) = rep["what_if"]
    assert (tried["finite"], tried.get("error")) == (True, None), tried


def test_unrecorded_greedy_cvrp_ends_with_nan_weights(tmp_path):
    """Without the recorder the greedy run's NaN log-likelihood reaches the update: the event
    above stops a real failure."""
    model = train("make_cvrp_greedy", tmp_path, bad=2, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_normalised_advantage_of_an_instance_whose_rollouts_tie_names_the_std(tmp_path):
    """Instance 3's nodes all lie on one point: every POMO rollout has length 0, so the
    advantage normalised by its standard deviation is 0/0. A loss event; the replay names the
    division, its line, the instance and an eps for the denominator; dropping the instance
    makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train("make_tsp", tmp_path, bad=3, normalize=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=3")
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "loss", "<loss>", "aten.div", [3]), o
    assert o["source"] == line_of("adv = adv / adv.std(1, keepdim=True)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"] and "eps" in rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_entropy_of_masked_probabilities_is_invalid_not_an_underflow(tmp_path):
    """An entropy bonus written ``-(p * p.log()).sum()`` over the decoder's probabilities: the
    visited nodes' probabilities are exactly 0 (softmax of the mask's -inf), their log -inf,
    0 * -inf NaN in every instance at the first step. Those zeros are the mask's, which
    exact arithmetic makes too: ``invalid``, not a softmax that underflowed (whose advice,
    clamping or log space, leaves the user to find the 0 * -inf); the hint names the product
    and the form whose limit is 0 there with a finite gradient, xlogy of a clamped log
    argument (xlogy(p, p)'s gradient is NaN at p = 0, in this trained decoder's backward)."""
    with pytest.raises(NonFiniteError) as info:
        train("make_tsp_entropy", tmp_path)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.log", "-inf", list(range(6))), o
    assert o["source"] == line_of("ent = ent - (probs * probs.log()).sum(2)"), o
    assert [c["op"] for c in o["chain"]] == ["aten.log", "aten.mul"], o["chain"]
    assert rep["cause"] == "invalid", (rep["cause"], rep["hint"])
    assert "underflow" not in rep["hint"], rep["hint"]
    assert "aten.mul (" + line_of("ent = ent - (probs") + ")" in rep["hint"], rep["hint"]
    assert "torch.special.xlogy(p, p.clamp_min(tiny))" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("make,amp", [("make_tsp", False), ("make_tsp", True),
                                      ("make_cvrp", False), ("make_cvrp_greedy", False)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, amp):
    """Every decoding step adds a mask holding -inf (visited nodes, the depot, over-capacity
    customers) before two softmaxes (under bfloat16 autocast too): no event, and bit-identical
    weights with and without the recorder (the multinomial draws from the global RNG
    included)."""
    recorded = train(make, tmp_path, amp=amp)
    plain = train(make, tmp_path, record=False, amp=amp)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_pointer(out_dir, bad: int | None = None, steps: int = 4, record: bool = True,
                  **rec_kw):
    """Supervised pointer network on solver tours (teacher forcing, nll of each step's
    log-softmax over the unvisited cities); ``bad``: that instance's tour in the last step's
    batch came in closed."""
    model = M.make_pointer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.pointer_loss, out_dir=out_dir,
                         factory="combinatorial_optimization_models:make_pointer",
                         **rec_kw) if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.pointer_loss
        for step in range(steps):
            cities, tours = M.solver_tours(g, closed=bad if step == steps - 1 else None)
            loss = loss_fn(model(cities, tours), tours)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
    return model


def test_pointer_network_log_probabilities_holding_the_mask_need_allow_inf(tmp_path):
    """The pointer's log-softmax over masked cities returns -inf for the visited ones, by
    design: without ``allow_inf`` the first step stops, and the replay names the masked_fill of
    a literal -inf and says which ``allow_inf`` records it."""
    with pytest.raises(NonFiniteError) as info:
        train_pointer(tmp_path)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"]) == (
        0, "", "aten.masked_fill", "-inf"), o
    assert "allow_inf" in rep["hint"], rep["hint"]


def test_pointer_network_closed_solver_tour_names_the_loss_and_the_instance(tmp_path):
    """Instance 4's label tour came in closed (its start city again at the end): the last
    step's target is a city the mask closed, its log-probability -inf, the nll +inf. A loss
    event; the replay names nll_loss, instance 4 (its rows of ``log_p.flatten(0, 1)``, 8 a
    sample), and a target on a masked class."""
    with pytest.raises(NonFiniteError) as info:
        train_pointer(tmp_path, bad=4, allow_inf=[""])
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    # (the output's log-probabilities hold the mask's -inf: not "the model output is finite")
    assert ev["detail"] == ("the loss is non-finite while the model output holds no NaN (its "
                            "+-Inf, allowed, reached the loss)"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.nll_loss_forward", "+inf", [4]), o
    assert o["source"] == line_of("return F.nll_loss(log_p.flatten(0, 1), tour.flatten())"), o
    assert rep["cause"] == "invalid" and "a target on a masked class" in rep["hint"], rep["hint"]


def test_healthy_pointer_network_under_allow_inf_trains_the_same(tmp_path):
    recorded = train_pointer(tmp_path, allow_inf=[""])
    plain = train_pointer(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
