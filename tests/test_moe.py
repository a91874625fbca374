"""End to end: a sparse mixture-of-experts layer written the way open-source MoE code writes
it (``moe_models``: top-k routing with renormalisation, GShard's -inf mask of the first
choice, Switch's capacity with dropped tokens, experts given no token, the load-balancing and
z losses), tokens flattened ``(B, T, D) -> (B * T, D)``, trained with AdamW under the recorder
until a planted bug fires, then replayed."""

from __future__ import annotations

import contextlib

import moe_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
PLANT_STEP = 2


def train(out_dir, factory: str, plant=None, steps: int = 4, record: bool = True):
    """The losses of ``steps`` steps, and the recorder's NonFiniteError (None: none);
    ``plant(model, step, ids, feats)`` writes the bug in before a step's forward."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g, losses, routed = torch.Generator().manual_seed(0), [], []
    rec = FlightRecorder(model, opt, loss_fn=M.lm_loss, out_dir=out_dir,
                         factory=f"moe_models:{factory}") if record else contextlib.nullcontext()
    try:
        with rec as r:
            for step in range(steps):
                ids, feats = M.batch(g)
                if plant is not None:
                    plant(model, step, ids, feats)
                routed.append(M.routing(model, ids, feats))
                logits, aux = model(ids, feats)
                loss = (r.loss_fn if record else M.lm_loss)(logits, ids) + 0.01 * aux
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return losses, routed, e
    return losses, routed, None


def uniform_at_plant(model, step, ids, feats):
    if step == PLANT_STEP:
        M.uniform_batch(ids, feats)


def test_healthy_moe_with_dropped_tokens_and_idle_experts_is_bit_identical(tmp_path):
    # a repeated token sends the whole batch to two experts: the others run on 0 rows, the
    # capacity drops most tokens, and GShard's second choice masks the first with -inf
    bare, routed, err = train(tmp_path, "make_moe_capacity", uniform_at_plant, record=False)
    recorded, _, event = train(tmp_path, "make_moe_capacity", uniform_at_plant)
    assert err is None and event is None, event and event.event
    assert recorded == bare
    idx, keep = routed[PLANT_STEP]
    assert len(idx.unique()) < M.EXPERTS and not keep.all()  # (what the batch exercises)
    assert not list(tmp_path.glob("*.nan"))


def test_mean_router_probability_of_an_expert_given_no_token_names_no_sample(tmp_path):
    # P_i written as the mean probability over the tokens routed to expert i: 0/0 for an
    # expert the repeated token's batch leaves idle, a number of the expert, not of a sample
    _, routed, err = train(tmp_path, "make_moe_expert_mean", uniform_at_plant)
    assert err is not None and (err.event["step"], err.event["phase"]) == (PLANT_STEP,
                                                                             "forward")
    assert len(routed[PLANT_STEP][0][:, 0].unique()) < M.EXPERTS  # (an expert idle)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was [0, 2, 3]: the idle experts' rows of the (E,) means, read as samples as E == B)
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "moe", "aten.mean", []), rep
    assert o["source"] == source_line("moe_models.py", "probs[idx[:, 0] == e, e].mean()")


def huge_record(model, step, ids, feats):
    # one token of sample 2 holds features of 3e38, signed so that the router's first logit
    # overflows float32: finite data, each of whose sums overflows
    if step == PLANT_STEP:
        feats[HUGE_ROW, 3] = 3e38 * torch.sign(model.moe.router.weight.detach()[0])


HUGE_ROW = 2


def test_router_overflow_of_a_huge_record_is_reproduced_on_its_sample(tmp_path):
    _, _, err = train(tmp_path, "make_moe", huge_record)
    assert err is not None and (err.event["step"], err.event["phase"]) == (PLANT_STEP,
                                                                             "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was "NOT reproduced": the recorder named the root, reading the record's inner inputs
    # as non-finite from their float32 sums; then moe.experts.0.fc1, the expert that completed
    # first, while the bisection named the router, whose logits overflowed before any expert
    # ran: the first op in execution order is the router's product, said by both)
    op = "aten.mm" if M.make_moe().moe.router.bias is None else "aten.addmm"
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "moe.router", op, "+inf", [HUGE_ROW]), rep
    assert rep["bisection"]["agrees"] and o["chain"][0]["op"] == op, rep
    assert o["source"] == source_line("moe_models.py", "logits = self.router(h)")
    assert f"sample(s) {HUGE_ROW} of" in rep["hint"], rep["hint"]
    assert any("float32 sum" in p for p in rep["problems"]), rep["problems"]


def corrupt_expert(model, step, ids, feats):
    if step == PLANT_STEP:
        model.moe.experts[CORRUPT].fc1.weight.data[3] = float("inf")


CORRUPT = 2


def test_expert_weights_the_loop_wrote_name_the_rows_of_its_tokens(tmp_path):
    _, routed, err = train(tmp_path, "make_moe", corrupt_expert)
    assert err is not None and err.event["step"] == PLANT_STEP
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    idx = routed[PLANT_STEP][0]
    # token r of the flattened (B * T, D) rows is sample r // T
    rows = sorted({int(r) // M.LENGTH for r in torch.where(idx == CORRUPT)[0]})
    assert (rep["reproduced"], rep["cause"], o["module"], o["samples"]) == (
        True, "weights", f"moe.experts.{CORRUPT}.fc1", rows), rep


def far_below_every_expert(model, step, ids, feats):
    # DeepSeek-V3's sigmoid scores: a token whose every router logit is -200 scores 0 in
    # float32 (1.4e-87 in float64), and the renormalised top-k weights divide 0 by 0
    if step == PLANT_STEP:
        w = model.moe.router.weight.detach()
        h = -200 * torch.linalg.pinv(w) @ torch.ones(M.EXPERTS)  # (w @ h = -200 each)
        feats[FAR_ROW, 4] = h - model.embed.weight.detach()[ids[FAR_ROW, 4]]


FAR_ROW = 1


def test_renormalised_weights_of_scores_that_underflowed_name_the_token_sample(tmp_path):
    _, _, err = train(tmp_path, "make_moe_sigmoid", far_below_every_expert)
    assert err is not None and (err.event["step"], err.event["phase"]) == (PLANT_STEP,
                                                                             "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "underflow", "moe", "aten.div", [FAR_ROW]), rep
    assert o["source"] == source_line("moe_models.py", "weights / weights.sum(-1, keepdim")
