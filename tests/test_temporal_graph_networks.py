"""End to end on temporal graph networks for link prediction (``temporal_graph_networks_models``):
TGN's GRU memory (a buffer detached between batches), JODIE's running time-gap
normalisation, TGAT's time encoding and graph attention over the most recent neighbours (padded
with ``-inf`` scores), BCE over positive and sampled negative destinations, batches of
consecutive events with neighbours from the loop's finder. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy version raises no event and
trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import temporal_graph_networks_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("temporal_graph_networks_models.py", text)


def history(finder: M.NeighborFinder, g: torch.Generator, events: int = 200) -> float:
    """The graph so far (training resumes on a new window of the stream): ``events`` past
    interactions among the old nodes, ending at time 0."""
    src = torch.randint(1, M.NODES - 1, (events,), generator=g)
    dst = (src + torch.randint(1, M.NODES - 3, (events,), generator=g) - 1) % (M.NODES - 2) + 1
    t = -torch.arange(events, 0, -1, dtype=torch.float) * 30
    finder.insert(src, dst, t, torch.randn(events, M.EDGE, generator=g))
    return 0.0


def train(make: str, out_dir, steps: int = 4, record: bool = True, warm: bool = True,
          amp: bool = False, start: float = 0.0, loss: str = "link_loss", **stream):
    """TGN's loop: Adam, gradient clipping, a step LR schedule; per batch the neighbours of
    ``cat([src, dst, neg])`` before the batch, the forward, the BCE, then the batch's events
    into the finder. ``amp``: fp16 autocast with a GradScaler; ``loss``: the models' loss
    function's name. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    g = torch.Generator().manual_seed(0)
    finder = M.NeighborFinder()
    if warm:
        start = history(finder, g)
    crit = getattr(M, loss)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler if amp else None,
                         factory=f"temporal_graph_networks_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for src, dst, neg, t, e in M.event_stream(g, steps, start=start, **stream):
            nbrs = finder.sample(torch.cat([src, dst, neg]), torch.cat([t, t, t]))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                pos, neg_logit = model(src, dst, neg, t, e, *nbrs)
                loss = loss_fn(pos.float(), neg_logit.float())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            finder.insert(src, dst, t, e)
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a: torch.nn.Module, b: torch.nn.Module):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


NEW_USER = dict(new_node=5, same_time=True)


@pytest.mark.parametrize("make,kw", [("make_tgn", NEW_USER), ("make_tgn_mha_fused", NEW_USER),
                                     ("make_tgn_unguarded", dict(steps=6)),
                                     ("make_tgn_mha", dict(amp=True, steps=6))])
def test_healthy_tgn_raises_nothing_and_trains_the_same(tmp_path, make, kw):
    """A new user in the last batch, the first batch a bulk import at one timestamp (std 0,
    eps kept): with TGN's guard, and with nn.MultiheadAttention called with
    need_weights=False (whose fused softmax gives a fully masked row zeros, no NaN); and the
    unguarded attention while every node has a neighbour (padding scores -inf in most rows):
    the -inf scores stay inside; TGN's own layer under fp16 autocast with a GradScaler, times
    in seconds since the stream began: no event, and weights and memory are bit-identical with
    and without the recorder."""
    recorded = train(make, tmp_path, **kw)
    plain = train(make, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


@pytest.mark.parametrize("new_as_dst", [False, True])
def test_new_node_without_neighbours_names_the_softmax_of_its_all_masked_row(tmp_path,
                                                                               new_as_dst):
    """TGAT's attention without TGN's guard: a user who first shows up in the last batch
    (event 5's source, or its destination) has no temporal neighbours, their attention row is
    ``-inf`` only, and softmax makes NaN there. The event and the replay name ``embedding`` at
    step 3; the replay the softmax on its line, event 5 (row 5, or 17, of the ``3B`` nodes
    ``cat([src, dst, neg])``: sample ``r % B``), invalid, and a fully masked row to keep one
    key in."""
    ev, bundle = fire("make_tgn_unguarded", tmp_path, new_node=5, new_as_dst=new_as_dst)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "embedding", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "embedding", "aten._softmax", "nan", [5]), o
    assert o["source"] == line_of("attn = scores.softmax(-1)"), o
    assert rep["cause"] == "invalid", rep
    assert "fully masked row" in rep["hint"] and "keep at least one key" in rep["hint"], rep["hint"]


def test_multihead_attention_of_a_new_node_names_the_softmax_and_the_padding_mask(tmp_path):
    """TGN's own attention layer (nn.MultiheadAttention, need_weights left at True as TGN
    calls it) without its guard: the new user's key_padding_mask is True at every neighbour
    slot, and the weights' explicit softmax makes NaN. The replay names the softmax inside
    ``embedding.mha``, the call's line, event 5, invalid, the fully masked row and the
    key_padding_mask that masks all of sample 5."""
    ev, bundle = fire("make_tgn_mha", tmp_path, new_node=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "embedding.mha", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "embedding.mha", "aten._softmax", "nan", [5]), o
    assert o["source"] == line_of("out, _ = self.mha(query, key, key, key_padding_mask=~mask"), o
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "fully masked row" in hint and "keep at least one key" in hint, hint
    assert "key_padding_mask is True (masked) at every position of samples [5]" in hint, hint


def test_bulk_import_at_one_timestamp_names_the_std_division_and_asks_for_an_eps(tmp_path):
    """JODIE's time-gap normalisation without an eps: the first batch is a bulk import at one
    timestamp, every node's gap since its last update (0, TGN's start) is the same, the
    running std the first batch starts is 0: 0/0 in every row at step 0. The replay names the
    division on its line in the root; the hint asks for an eps on the std, not a nonzero start
    of ``last_update`` (random values there make the gaps differ, a constant does not)."""
    ev, bundle = fire("make_tgn_no_eps", tmp_path, same_time=True, warm=False)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "", list(range(M.B))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        True, "", "aten.div", "nan", True), o
    assert o["source"] == line_of("return (dt - self.dt_mean) / (self.dt_var.sqrt()"), o
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "buffer last_update" in hint and "all equal" in hint, hint
    assert "add an eps to the divisor" in hint and "start it nonzero" not in hint, hint


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_epoch_seconds_in_fp16_autocast_overflow_the_time_encoding(tmp_path):
    """Raw time gaps (TGN's default, no normalisation) under fp16 autocast with a GradScaler,
    timestamps in epoch seconds: a node's first gap is its timestamp itself (~1.7e9), past
    fp16's 65504, so autocast's cast of the time encoding's input is +inf (then NaN through
    the frequencies). The scaler skips the step (PyTorch warns the scheduler stepped first);
    the event and the replay name ``time.w`` at step 0, the cast on the encoding's line, every
    event, overflow of float16, and to rescale the input or compute it in float32."""
    ev, bundle = fire("make_tgn_raw_time", tmp_path, amp=True, warm=False, start=1.7e9)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "time.w", list(range(M.B))), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["call"], o["op"], o["made"], o["all_samples"]) == (
        True, "time.w", 0, "aten._to_copy", "+inf", True), o
    assert o["source"] == line_of("return torch.cos(self.w(dt.unsqueeze(-1)))"), o
    assert rep["cause"] == "overflow", rep
    hint = rep["hint"]
    assert "beyond float16's largest value" in hint and "rescale its inputs" in hint, hint


def test_new_node_zeroed_after_attention_names_the_softmax_behind_the_backward(tmp_path):
    """TGAT's half of the guard: the attention output of a node with no neighbours is zeroed
    after the softmax, its mask left all False. The forward stays finite (masked_fill replaces
    the NaN row), but the backward of ``attn @ val`` multiplies that saved NaN row by the zero
    gradient the fill sends: NaN gradients at step 3. The replay names that node on its line,
    the softmax that made the NaN it saved (the chain's start), invalid (a softmax of an all
    -inf row is NaN in float64 too, though the forward's outputs are finite), and the fully
    masked row's fix, and event 5 as its sample."""
    ev, bundle = fire("make_tgn_zero_after", tmp_path, new_node=5)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    assert "embedding.q.weight" in ev["params"], ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "backward", "embedding", "BmmBackward0"), o
    # (the bmm's rows are the 3B nodes' heads, looked up by cat([src, dst, neg]): event 5's)
    assert o["samples"] == [5], o
    assert o["source"] == line_of("ctx = (attn @ val).transpose(1, 2)"), o
    assert [(c["op"], c["source"]) for c in o["chain"]][0] == (
        "aten._softmax", line_of("attn = scores.softmax(-1)")), o["chain"]
    assert rep["cause"] == "invalid", rep["hint"]
    hint = rep["hint"]
    assert "made by aten._softmax" in hint and "fully masked row" in hint, hint
    assert "keep at least one key" in hint, hint


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_neighbour_padding_at_time_zero_overflows_the_fp16_time_encoding(tmp_path):
    """Gaps normalised, but the neighbour finder pads with time 0 (TGN's padding) while the
    stream's timestamps are epoch seconds: a padded neighbour's ``t - t_j`` is the timestamp
    itself, and autocast's fp16 cast of it in the third call of the time encoding (the
    neighbours', after the memory's and phi(0)) is +inf. The replay names that call, the
    cast, every event (the first batch's nodes have no neighbours yet) and fp16's range."""
    ev, bundle = fire("make_tgn", tmp_path, amp=True, warm=False, start=1.7e9)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (0, "forward", "time.w", 2), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["all_samples"]) == (
        "time.w", 2, "aten._to_copy", "+inf", True), o
    assert rep["cause"] == "overflow" and "beyond float16's largest value" in rep["hint"], rep


def test_raw_amount_edge_feature_names_the_log_of_the_saturated_sigmoid(tmp_path):
    """A transaction amount in cents (2.5e6, not standardised) as event 3's edge feature at
    step 2; at step 3 it is a temporal neighbour's feature of node 1, the key projection of
    the attention scales it up, and event 5's positive logit (-1715) saturates the hand-written
    BCE's sigmoid to 0: the loss's log is -inf there. The replay names the log in the loss,
    event 5 (the only row an unrecorded run's logits put below the sigmoid's range),
    underflow with BCEWithLogitsLoss/logsigmoid, and the key projection's absmax jump at
    this step as the precursor that points at the neighbour features."""
    ev, bundle = fire("make_tgn", tmp_path, loss="prob_link_loss", amount=(2, 3))
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", [5]), o
    assert o["source"] == line_of("return -(torch.log(p_pos).mean()"), o
    assert rep["cause"] == "underflow" and "logsigmoid or BCEWithLogitsLoss" in rep["hint"], rep
    assert [(p["step"], p["kind"]) for p in rep["precursors"]] == [(3, "absmax_jump")], rep
    assert rep["precursors"][0]["detail"].startswith("absmax of embedding.k jumped"), rep
