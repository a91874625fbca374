"""End to end on GFlowNets over torchgfn's hypergrid (``gflownets_models``): trajectory balance
with a learned log Z (its own Adam group at a higher learning rate, as torchgfn trains it),
trajectories sampled inside ``forward`` with epsilon-uniform exploration and masked policies,
and detailed balance with a state-flow head over padded trajectories from a replay buffer,
and flow matching over the visited states.
Each planted bug of the domain fires under the recorder and is replayed with the CLI; the
healthy versions (one of them making NaN inside ``forward`` that a ``torch.where`` keeps out)
raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import gflownets_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


def line_of(text: str) -> str:
    return source_line("gflownets_models.py", text)


def train_tb(make: str, out_dir, r0: float = 1e-3, steps: int = 6, record: bool = True,
             clip_min: float | None = None):
    """torchgfn's trajectory-balance recipe: Adam, log Z in its own group at lr 0.1, gradient
    clipping, a step schedule. Returns the model."""
    model = getattr(M, make)()
    crit = M.TBLoss(r0, clip_min)
    opt = torch.optim.Adam([
        {"params": [*model.pf.parameters(), *model.pb.parameters()], "lr": 1e-3},
        {"params": [model.log_z], "lr": 0.1}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    torch.manual_seed(1)  # (the sampler's draws inside forward)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"gflownets_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for _ in range(steps):
            loss = loss_fn(*model(torch.zeros(BATCH, M.D, dtype=torch.long)))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
    return model


def db_batches(steps: int, r0: float = 1e-2):
    """Batches of padded trajectories drawn from a replay buffer of random ones, with the log
    reward of each terminal state."""
    g = torch.Generator().manual_seed(0)
    buffer = M.rollout(g, 64)
    for _ in range(steps):
        idx = torch.randint(len(buffer), (BATCH,), generator=g)
        states, actions, pad = M.pad_trajectories([buffer[i] for i in idx])
        yield states, actions, pad, torch.log(M.hypergrid_reward(states[:, -1], r0))


def train_db(make: str, out_dir, steps: int = 4, record: bool = True, r0: float = 1e-2):
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.db_loss, out_dir=out_dir,
                         factory=f"gflownets_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.db_loss
        for states, actions, pad, log_r in db_batches(steps, r0):
            loss = loss_fn(model(states, actions, pad, log_r), pad)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def fm_states(steps: int, with_start: bool):
    """Each step's visited states of 8 fresh random trajectories, and their log rewards."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        s = M.visited_states(M.rollout(g, 8), with_start)
        yield s, torch.log(M.hypergrid_reward(s, 1e-2))


def train_fm(make: str, out_dir, steps: int = 4, record: bool = True, with_start: bool = False):
    """Flow matching over the states of on-the-fly trajectories; ``with_start``: the start
    state too (the bug)."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=M.fm_loss, out_dir=out_dir,
                         factory=f"gflownets_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.fm_loss
        for s, log_r in fm_states(steps, with_start):
            loss = loss_fn(*model(s, log_r))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def fire(run, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        run(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_log_of_a_zero_reward_names_the_log_in_the_loss_and_the_zero_reward_states(tmp_path):
    """The "hard" hypergrid (``R0 = 0``): every terminal state off the modes has reward
    exactly 0, and ``log R(x)`` in the trajectory-balance loss is -inf at the first step. A
    loss event; the replay names the log on its line, the trajectories whose terminal state
    has reward 0 (counted on an unrecorded copy of the step), and says to clamp."""
    model = M.make_tb()
    torch.manual_seed(1)
    x = model(torch.zeros(BATCH, M.D, dtype=torch.long))[3]
    zero = (M.hypergrid_reward(x, 0.0) == 0).nonzero().flatten().tolist()
    assert 0 < len(zero) < BATCH, zero
    ev, bundle = fire(train_tb, "make_tb", tmp_path, r0=0.0)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.log", "-inf", zero), o
    assert o["source"] == line_of("log_r = torch.log(hypergrid_reward(x, self.r0))"), o
    assert rep["cause"] == "invalid" and "clamp" in rep["hint"], rep["hint"]


def test_log_z_learning_rate_diverging_names_the_overflowing_square_and_the_divergence(
        tmp_path):
    """Log Z in its own group at a rate 3000x the policies' (recipes give log Z a much higher
    rate, there under Adam, whose steps the rate bounds), here under SGD with momentum and
    no clipping: log Z overshoots the balance by more at every step, the loss jumps at step 2
    and the squared log-ratio overflows at step 9. The replay names the square on its line,
    overflow, the loss's jump at step 2 and the advice to lower the learning rate."""
    model = M.make_tb()
    opt = torch.optim.SGD([
        {"params": [*model.pf.parameters(), *model.pb.parameters()], "lr": 1e-3},
        {"params": [model.log_z], "lr": 3.0}], momentum=0.9)
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.TBLoss(), out_dir=tmp_path,
            factory="gflownets_models:make_tb") as rec:
        for _ in range(20):
            loss = rec.loss_fn(*model(torch.zeros(BATCH, M.D, dtype=torch.long)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (9, "loss", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.pow", "+inf"), o
    assert o["source"] == line_of("return (log_z + log_pf - log_r - log_pb).pow(2).mean()"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "diverging" in rep["hint"] and "lower the learning rate" in rep["hint"], rep["hint"]
    assert (rep["precursors"][0]["kind"], rep["precursors"][0]["step"]) == ("loss_jump", 2)


def test_clipped_log_reward_of_the_hard_grid_raises_nothing_and_trains_the_same(tmp_path):
    """The hard grid (``R0 = 0``) with torchgfn's ``log_reward_clip_min``: ``log R(x)`` is -inf
    inside the loss at every step and the clamp takes it to -100 before the loss uses it. No
    event, and bit-identical finite weights with and without the recorder."""
    recorded = train_tb("make_tb", tmp_path, r0=0.0, clip_min=-100.0)
    plain = train_tb("make_tb", tmp_path, r0=0.0, clip_min=-100.0, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b) and torch.isfinite(a).all(), name


def masked_actions_taken(steps: int) -> tuple[int, list[int]]:
    """The iteration of the sampling loop at which the exploration first took an action the
    mask forbids in the step after ``steps``, and the trajectories that took it (counted on
    an unrecorded copy of the run)."""
    model = train_tb("make_tb_uniform_over_all", None, steps=steps, record=False)
    taken, explore = [], model.explore

    def spy(logits, mask):
        act = explore(logits, mask)
        taken.append((~mask.gather(-1, act[:, None])).flatten().nonzero().flatten().tolist())
        return act

    model.explore = spy
    model(torch.zeros(BATCH, M.D, dtype=torch.long))
    it = next(i for i, rows in enumerate(taken) if rows)
    return it, taken[it]


def test_exploration_over_masked_actions_names_the_gather_of_the_action_taken(tmp_path):
    """Epsilon-uniform exploration spread over every action, valid or not: at a grid edge a
    trajectory steps off the grid, and the forward policy's log-probability of that action,
    gathered from the masked ``log_softmax``, is -inf (the -inf sum of log PF in the model's
    output). Every step also makes a NaN the sum never sees: the backward policy's
    ``log_softmax`` at the start state, whose every parent is masked, kept out by
    ``torch.where(moved, lb, 0)``. The replay names the gather (not that dropped NaN, nor a
    mask's fill), its line and run (the loop's iteration), the trajectory, and says the
    index points at a masked entry."""
    it, rows = masked_actions_taken(steps=5)
    ev, bundle = fire(train_tb, "make_tb_uniform_over_all", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        5, "forward", "", "-inf", rows), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["line_run"]) == (
        "", "aten.gather", "-inf", rows, it + 1), o
    assert o["source"] == line_of("lp = logits.log_softmax(-1).gather(-1, act[:, None])"), o
    assert [c["op"] for c in o["chain"]] == ["aten.gather"], o["chain"]
    assert rep["cause"] == "invalid", rep
    assert "index" in rep["hint"] and "allowed" in rep["hint"], rep["hint"]
    assert "allow_inf" not in rep["hint"] and not rep["problems"], rep


def test_unrecorded_exploration_over_masked_actions_breaks_the_weights(tmp_path):
    """Without the recorder the same run's -inf log PF makes the loss +inf and the clipped
    update NaN: the event above is the bug, not a false alarm."""
    model = train_tb("make_tb_uniform_over_all", None, steps=6, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_sink_padding_times_a_zero_mask_names_the_fully_masked_log_softmax(tmp_path):
    """Detailed balance over trajectories padded with the sink state, whose every forward
    action is masked: its ``log_softmax`` row is all -inf, NaN, and ``delta * pad`` keeps the
    NaN (NaN * 0). The replay names the log_softmax on its line, every trajectory shorter
    than the longest (the padded ones), the fully masked row, and the product that kept the
    NaN it was meant to drop, with torch.where as the way to drop it."""
    ev, bundle = fire(train_db, "make_db", tmp_path)
    _, _, pad, _ = next(db_batches(1))
    padded = (~pad.all(1)).nonzero().flatten().tolist()
    assert 0 < len(padded) < BATCH, padded
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        0, "forward", "", "nan", padded), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten._log_softmax", "nan", padded), o
    assert o["source"] == line_of("lpf = logits.log_softmax(-1).gather(-1, actions[..., None])")
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    kept = f"aten.mul ({line_of('return delta * pad')}) then multiplied those NaN by a mask's 0"
    assert kept in rep["hint"] and "torch.where(mask, x, 0)" in rep["hint"], rep["hint"]


def test_log_reward_of_zero_in_the_buffer_is_an_input_event_on_those_trajectories(tmp_path):
    """The replay buffer stores ``log R(x)`` computed in the data pipeline, on the hard grid
    (``R0 = 0``): a terminal state off the modes has log reward -inf, given to the model as
    its fourth argument. An input event at step 0; the replay names that argument, the
    trajectories ending off the modes, and log(0) with the clamp to add."""
    _, _, _, log_r = next(db_batches(1, 0.0))
    zero = (log_r == float("-inf")).nonzero().flatten().tolist()
    assert 0 < len(zero) < BATCH, zero
    ev, bundle = fire(train_db, "make_db_healthy", tmp_path, r0=0.0)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        0, "input", "args[3]", zero), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["made"], o["samples"]) == (
        "input", "args[3]", "-inf", zero), o
    assert rep["cause"] == "input" and "log(0)" in rep["hint"], rep["hint"]
    assert "clamp" in rep["hint"], rep["hint"]


def test_flow_matching_over_the_start_state_names_the_logsumexp_of_no_parent(tmp_path):
    """Flow matching's loop over the visited states from t = 0 instead of 1: the start state
    has no parent, its in-flow is the logsumexp of a row of -inf only. The replay names that
    logsumexp on its line, the start states' rows (one per trajectory in the flattened
    batch) and the fully masked row."""
    s, _ = next(fm_states(1, True))
    starts = (s == 0).all(1).nonzero().flatten().tolist()
    assert len(starts) == 8, starts
    ev, bundle = fire(train_fm, "make_fm", tmp_path, with_start=True)
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (
        0, "forward", "-inf", starts), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "", "aten.logsumexp", "-inf", starts), o
    assert o["source"] == line_of("log_in = into.masked_fill(~backward_mask(s)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("run,make", [(train_tb, "make_tb"), (train_db, "make_db_where"),
                                      (train_db, "make_db_healthy"), (train_fm, "make_fm")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, run, make):
    """Trajectory balance with exploration over the valid actions only (and the backward
    policy's dropped NaN at the start state in every step); detailed balance whose sink rows'
    NaN is kept out by ``torch.where`` (masked_fill's backward zeroes their gradient); and with
    the terminal state's mask on the padding; flow matching from t = 1 (its -inf in-flow
    entries at a coordinate 0 stay inside the logsumexp): no event, bit-identical weights
    with and without the recorder."""
    recorded = run(make, tmp_path)
    plain = run(make, tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name
