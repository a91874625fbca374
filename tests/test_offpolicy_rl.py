"""End to end: off-policy RL loops as CleanRL and Stable-Baselines3 write them. SAC's critic
(SB3's twin ``ContinuousCritic``) and actor each recorded with their own optimizer, while
``log_alpha``'s optimizer and the Polyak updates of the target critic run unrecorded; the
actor steps every 2nd iteration. C51's categorical projection onto fixed atoms. Planted:
the squash correction's eps dropped (log(0) when tanh rounds to 1), C51's projection without
its ``(l == u)`` term (a terminal transition's mass dropped, then renormalised: 0/0)."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import offpolicy_rl_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "offpolicy_rl_models.py"
GLITCH = 5  # the transition of the sampled batch whose observation a sensor glitch scaled


def filled_buffer(size: int = 256) -> M.ReplayBuffer:
    rb, rng = M.ReplayBuffer(size), np.random.default_rng(0)
    for _ in range(size):
        o = rng.standard_normal(M.OBS).astype(np.float32)
        rb.add(o, o + 0.1 * rng.standard_normal(M.OBS), rng.uniform(-1, 1, M.ACT),
               rng.standard_normal(), rng.random() < 0.05)
    return rb


def sac(out_dir, actor_factory="make_actor", record=("critic", "actor"), iters=10,
        glitch=None, seen=None):
    """CleanRL's SAC update with SB3's twin critic. ``glitch``: (iteration, "obs" or
    "next_obs"), the batch field whose row GLITCH is scaled by 1e4 (an unnormalised reading).
    ``seen``: filled with each recorder's step after the loop."""
    actor, critic = getattr(M, actor_factory)(), M.make_critic()
    critic_target = copy.deepcopy(critic).requires_grad_(False)
    log_alpha = torch.zeros(1, requires_grad=True)
    q_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    a_opt = torch.optim.Adam([log_alpha], lr=1e-3)
    rb, recs = filled_buffer(), {}
    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        if "critic" in record:
            recs["critic"] = stack.enter_context(FlightRecorder(
                critic, q_opt, loss_fn=M.twin_q_loss, out_dir=out_dir,
                factory="offpolicy_rl_models:make_critic"))
        if "actor" in record:
            recs["actor"] = stack.enter_context(FlightRecorder(
                actor, actor_opt, out_dir=out_dir,
                factory=f"offpolicy_rl_models:{actor_factory}"))
        q_loss = recs["critic"].loss_fn if "critic" in recs else M.twin_q_loss
        for it in range(iters):
            obs, actions, next_obs, rewards, dones = rb.sample(16)
            if glitch is not None and glitch[0] == it:
                (obs if glitch[1] == "obs" else next_obs)[GLITCH] *= 1e4
            alpha = log_alpha.detach().exp()
            with torch.no_grad():
                next_a, next_log_pi, _ = actor.get_action(next_obs)
                min_qt = torch.min(*critic_target(next_obs, next_a)) - alpha * next_log_pi
                next_q = rewards.flatten() + (1 - dones.flatten()) * 0.99 * min_qt.view(-1)
            qf_loss = q_loss(critic(obs, actions), next_q)
            q_opt.zero_grad()
            qf_loss.backward()
            q_opt.step()
            if it % 2 == 0:  # delayed policy update
                pi, log_pi, _ = actor.get_action(obs)
                actor_loss = (alpha * log_pi - torch.min(*critic(obs, pi))).mean()
                actor_opt.zero_grad()
                actor_loss.backward()
                actor_opt.step()
                alpha_loss = (-log_alpha.exp() * (log_pi.detach() - M.ACT)).mean()
                a_opt.zero_grad()
                alpha_loss.backward()
                a_opt.step()
            M.soft_update(critic, critic_target, 0.005)
        if seen is not None:
            seen.update({k: r.step for k, r in recs.items()})
    return [m.state_dict() for m in (actor, critic, critic_target)] + [log_alpha.detach()]


def same(a, b) -> bool:
    flat = [(x, y) for s, t in zip(a, b) for x, y in
            (zip(s.values(), t.values()) if isinstance(s, dict) else [(s, t)])]
    return all(torch.equal(x, y) for x, y in flat)


def test_a_healthy_sac_run_under_two_recorders_is_silent_and_bit_identical(tmp_path):
    """Critic and actor each recorded with their optimizer; alpha's optimizer and the target
    critic's Polyak update unrecorded. No event, no bundle, the same weights as without the
    recorders, and each recorder counted its own optimizer's steps (the actor's every 2nd)."""
    seen: dict[str, int] = {}
    recorded = sac(tmp_path, seen=seen)
    assert same(recorded, sac(tmp_path, record=()))
    assert seen == {"critic": 10, "actor": 5}
    assert not list(tmp_path.glob("*.nan"))


def test_a_td_target_made_infinite_by_the_squash_correction_is_the_critics_input(tmp_path):
    """``log(1 - tanh(u)^2)`` without eps: a glitched next observation saturates tanh, the
    target actor's log-prob is +inf and the TD target -inf for that transition only. The critic's
    recorder sees it as a loss target (its own forward is finite) at the step it happened."""
    with pytest.raises(NonFiniteError) as info:
        sac(tmp_path, "make_actor_no_eps", glitch=(5, "next_obs"))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["kind"], ev["samples"]) == \
        (5, "input", "loss_args[1]", "-inf", [GLITCH])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "input", rep["cause"]
    assert rep["origin"]["samples"] == [GLITCH]
    assert "target network" in rep["hint"], rep["hint"]


def test_the_actors_own_log_0_is_an_event_of_the_actors_step(tmp_path):
    """The glitch in the current observation of iteration 4 reaches the actor's loss: the
    actor's recorder (stepped at iterations 0, 2, 4) raises at its step 2, before its update,
    blaming that transition; the squash correction is in ``get_action``, outside the forward,
    so the replay names the gradient entering the log_std output, not an op."""
    with pytest.raises(NonFiniteError) as info:
        sac(tmp_path, "make_actor_no_eps", record=("actor",), glitch=(4, "obs"))
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and o["phase"] == "loss" and o["samples"] == [GLITCH], o
    assert "loss_fn" in rep["hint"]


def c51(out_dir, keep_tied=True, record=True, iters=60, targets=None, nan_obs_at=None):
    """CleanRL's C51 loop: epsilon-greedy acting under no_grad between updates (forwards of
    the recorded network that open no step), an update every 2nd iteration after 20, the
    target network copied with ``_foreach_lerp_`` every 5 updates."""
    q = M.make_c51()
    tq = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=2.5e-4, eps=0.01 / 32)
    rb, rng = M.ReplayBuffer(512), np.random.default_rng(0)
    rec = FlightRecorder(q, opt, loss_fn=M.c51_loss, out_dir=out_dir,
                         factory="offpolicy_rl_models:make_c51") if record else None
    updates = 0
    with rec or contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec else M.c51_loss
        obs = rng.standard_normal(M.OBS).astype(np.float32)
        for it in range(iters):
            if it == nan_obs_at:
                obs[2] = np.nan  # the environment returned a NaN reading
            a = rng.integers(3)
            if rng.random() > 0.3:
                with torch.no_grad():
                    a = q(torch.as_tensor(obs)[None])[0].item()
            nobs = (0.9 * obs + 0.1 * rng.standard_normal(M.OBS)).astype(np.float32)
            done = rng.random() < 0.1
            rb.add(obs, nobs, np.array([a, 0]), 0.0 if done else rng.standard_normal(), done)
            obs = rng.standard_normal(M.OBS).astype(np.float32) if done else nobs
            if it >= 20 and it % 2 == 0:
                o, act, no, rew, d = rb.sample(16)
                with torch.no_grad():
                    target = M.project_c51(tq(no)[1], rew, d, tq.atoms, 0.99, keep_tied)
                if targets is not None:
                    targets.append(target)
                loss = loss_fn(q(o, act[:, 0].long())[1], target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                updates += 1
                if updates % 5 == 0:
                    M.soft_update_foreach(q, tq, 1.0)
    return [q.state_dict(), tq.state_dict()]


def test_a_nan_observation_while_acting_is_an_evaluation_input_event(tmp_path):
    """The epsilon-greedy action of iteration 24 (after 2 updates) is a no_grad forward
    between steps: an evaluation forward before step 2, its one sample the NaN reading."""
    with pytest.raises(NonFiniteError) as info:
        c51(tmp_path, nan_obs_at=24)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"], ev["evaluation"]) == \
        (2, "input", "batch", [0], True), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "input" and rep["reproduced"] is True


def test_a_healthy_c51_run_is_silent_and_bit_identical(tmp_path):
    assert same(c51(tmp_path), c51(tmp_path, record=False))
    assert not list(tmp_path.glob("*.nan"))


def test_a_c51_projection_that_drops_an_atoms_mass_names_the_empty_target(tmp_path):
    """Without ``(l == u)``, a terminal transition with reward 0 lands on atom 50 exactly:
    its whole mass is dropped, and the loss's renormalisation is 0/0 on that row. The report
    names the division, its line, the transition, and the target with no mass, not a
    degenerate record of the dataset. The acting forwards between updates open no step."""
    targets: list[torch.Tensor] = []
    with pytest.raises(NonFiniteError) as info:
        c51(tmp_path, keep_tied=False, targets=targets)
    empty = (targets[-1].sum(-1) == 0).nonzero().flatten().tolist()
    assert empty and not any(bool((t.sum(-1) == 0).any()) for t in targets[:-1])
    step = len(targets) - 1  # (the updates: the acting forwards between them are no steps)
    assert (info.value.event["step"], info.value.event["phase"]) == (step, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["module"], o["samples"], rep["cause"]) == \
        ("aten.div", "<loss>", empty, "invalid"), rep
    assert o["source"].startswith(source_line(MODELS, "target_pmfs / target_pmfs.sum("))
    rows = ",".join(map(str, empty))
    assert f"loss_args[1], non-negative weights per sample (a target distribution), holds " \
        f"no mass at sample(s) {rows}" in rep["hint"], rep["hint"]
    assert "dataset" not in rep["hint"]


def td3(out_dir, record=True, iters=10, seen=None):
    """CleanRL's TD3: target policy smoothing noise drawn in the loop, the actor and the
    Polyak updates (``_foreach_lerp_``) every 2nd iteration only."""
    actor, critic = M.make_td3_actor(), M.make_critic()
    actor_target = copy.deepcopy(actor).requires_grad_(False)
    critic_target = copy.deepcopy(critic).requires_grad_(False)
    q_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    rb, recs = filled_buffer(), {}
    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        if record:
            recs["critic"] = stack.enter_context(FlightRecorder(
                critic, q_opt, loss_fn=M.twin_q_loss, out_dir=out_dir,
                factory="offpolicy_rl_models:make_critic"))
            recs["actor"] = stack.enter_context(FlightRecorder(
                actor, actor_opt, out_dir=out_dir, factory="offpolicy_rl_models:make_td3_actor"))
        q_loss = recs["critic"].loss_fn if record else M.twin_q_loss
        for it in range(iters):
            obs, actions, next_obs, rewards, dones = rb.sample(16)
            with torch.no_grad():
                noise = (torch.randn_like(actions) * 0.2).clamp(-0.5, 0.5)
                next_a = (actor_target(next_obs) + noise).clamp(-1.0, 1.0)
                min_qt = torch.min(*critic_target(next_obs, next_a))
                next_q = rewards.flatten() + (1 - dones.flatten()) * 0.99 * min_qt.view(-1)
            qf_loss = q_loss(critic(obs, actions), next_q)
            q_opt.zero_grad()
            qf_loss.backward()
            q_opt.step()
            if it % 2 == 0:
                actor_loss = -critic(obs, actor(obs))[0].mean()
                actor_opt.zero_grad()
                actor_loss.backward()
                actor_opt.step()
                M.soft_update_foreach(actor, actor_target, 0.005)
                M.soft_update_foreach(critic, critic_target, 0.005)
        if seen is not None:
            seen.update({k: r.step for k, r in recs.items()})
    return [m.state_dict() for m in (actor, critic, actor_target, critic_target)]


def test_a_healthy_td3_run_with_delayed_actor_updates_is_silent_and_bit_identical(tmp_path):
    """The critic's forward in the actor's update is the first micro-batch of the critic's
    next step (its gradients zeroed by ``q_opt.zero_grad()``): no event, no change."""
    seen: dict[str, int] = {}
    assert same(td3(tmp_path, seen=seen), td3(tmp_path, record=False))
    assert seen == {"critic": 10, "actor": 5}
    assert not list(tmp_path.glob("*.nan"))


def test_an_agent_container_with_no_forward_is_said_when_the_recorder_is_built(tmp_path, caplog):
    """CleanRL's networks held in one module with no forward (``SAC``: actor, twin critics,
    their targets, ``log_alpha``): the loop calls the submodules, so no step ever opens. The
    recorder says so at once, naming the networks and what to record instead, not only after
    the first update."""
    agent = M.make_sac()
    q_opt = torch.optim.Adam([*agent.qf1.parameters(), *agent.qf2.parameters()], lr=1e-3)
    with caplog.at_level("WARNING", logger="nanreplay"), \
            FlightRecorder(agent, q_opt, out_dir=tmp_path, factory="offpolicy_rl_models:make_sac"):
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "SAC has no forward of its own" in said[0], said
        assert "(actor, qf1, qf2, qf1_target)" in said[0], said[0]
    critic = M.make_critic()  # (the recorder holds its model weakly)
    with FlightRecorder(critic, None, out_dir=tmp_path):  # (a forward: nothing said)
        assert len(caplog.records) == 1


def qr_dqn_per(out_dir, weight_eps=0.0, record=True, iters=20, zeros=None):
    """SB3-contrib's QR-DQN loss on prioritized replay. New transitions' priorities start at
    0 (the second half of the buffer); the sampling adds 0.01 to every priority, the
    importance weights ``(N * P(i)) ** -beta / max w`` add ``weight_eps``. ``zeros``: for
    each update, the batch positions whose transition had priority 0."""
    q = M.make_qr()
    tq = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=5e-4)
    rb, rng = M.ReplayBuffer(64), np.random.default_rng(1)
    prio = np.zeros(64)
    for _ in range(64):
        o = rng.standard_normal(M.OBS).astype(np.float32)
        rb.add(o, o, np.array([rng.integers(3), 0]), rng.standard_normal(), rng.random() < 0.1)
    prio[:32] = 1.0
    rec = FlightRecorder(q, opt, loss_fn=M.quantile_huber_loss, out_dir=out_dir,
                         factory="offpolicy_rl_models:make_qr") if record else None
    with rec or contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec else M.quantile_huber_loss
        for _ in range(iters):
            p = (prio + 0.01) ** 0.6
            idx = rng.choice(64, size=16, p=p / p.sum())
            if zeros is not None:
                zeros.append(np.flatnonzero(prio[idx] == 0).tolist())
            o, a, no, r, d = rb.take(idx)
            w = M.per_weights((prio + weight_eps) ** 0.6, idx, beta=0.4)
            with torch.no_grad():
                nq = tq(no)
                target = r + 0.99 * (1 - d) * nq[torch.arange(16), :, nq.mean(1).argmax(1)]
            cur = q(o)[torch.arange(16), :, a[:, 0].long()]
            loss = loss_fn(cur, target, w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                prio[idx] = (target.unsqueeze(-2) - cur.unsqueeze(-1)).abs().mean((1, 2)).numpy()
    return [q.state_dict()]


def test_a_healthy_qr_dqn_on_prioritized_replay_is_silent_and_bit_identical(tmp_path):
    assert same(qr_dqn_per(tmp_path, 0.01), qr_dqn_per(tmp_path, 0.01, record=False))
    assert not list(tmp_path.glob("*.nan"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy: 0 ** -beta, inf / inf)
def test_an_importance_weight_of_a_priority_of_0_names_the_infinite_normalisation(tmp_path):
    """The first batch drawing a transition of priority 0: its weight is 0^-beta = inf, the
    max inf, so inf/inf = NaN for it and 0 for every other sample. An ``input`` event on the
    weights, at that update, naming those transitions; the hint reads the 0s beside the NaN
    as a normalisation by an infinite total and names the priority of 0."""
    zeros: list[list[int]] = []
    with pytest.raises(NonFiniteError) as info:
        qr_dqn_per(tmp_path, zeros=zeros)
    assert zeros[-1] and not any(zeros[:-1])
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["kind"], ev["samples"]) == \
        (len(zeros) - 1, "input", "loss_args[2]", "nan", zeros[-1])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "input" and rep["origin"]["samples"] == zeros[-1], rep["origin"]
    assert "every finite entry of loss_args[2] is exactly 0, beside its NaNs" in rep["hint"]
    assert "transition of priority 0 is 0^−β = inf" in rep["hint"], rep["hint"]


def test_a_squash_log_0_in_the_actors_own_forward_names_the_log_and_its_line(tmp_path):
    """The actor's forward computes the log-probability (SpinningUp's actor) without the
    eps; the glitch is in the current observation of iteration 4, whose actor update is the
    actor's step 2. Its training forward returns +inf: a forward event of that step (the
    critic, whose forward in that update was finite, raises nothing). The replay names the
    log, its line, the transition and tanh rounded to 1: precision."""
    with pytest.raises(NonFiniteError) as info:
        sac(tmp_path, "make_squashed_actor_no_eps", glitch=(4, "obs"))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "forward", [GLITCH]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.log", "-inf", [GLITCH], "precision"), (o, rep["cause"])
    line = "correction = torch.log(self.action_scale * (1 - y_t.pow(2)) + self.eps)"
    assert o["source"].startswith(source_line(MODELS, line)), o["source"]
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert "2·(log 2 − u − softplus(−2u))" in rep["hint"], rep["hint"]


def test_a_squash_log_0_in_the_actors_no_grad_target_forward_reaches_the_critic(tmp_path):
    """The same actor, the glitch in the next observation of iteration 5: the actor's no_grad
    forward for the TD target is an evaluation forward whose +inf output no loss of the actor
    takes (no event, by design); the critic's recorder names the target it reached."""
    with pytest.raises(NonFiniteError) as info:
        sac(tmp_path, "make_squashed_actor_no_eps", glitch=(5, "next_obs"))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (5, "input", "loss_args[1]", [GLITCH]), ev
    assert [p.name for p in tmp_path.glob("*.nan")] == ["step00000005-rank0.nan"]


# A single-file script's network (CleanRL's ``dqn.py`` defines its QNetwork in ``__main__``),
# which the replay cannot import to rebuild
ScriptPolicy = type("DQNPolicy", (M.DQNPolicy,), {"__module__": "__main__"})


def dqn(out_dir, record=True, bad_tau_at=None):
    """SB3's DQN: its policy holds ``q_net`` and ``q_net_target``, the loop calls the target
    under no_grad and Polyak-averages it in place after each update (``tau`` NaN at
    iteration ``bad_tau_at``: a schedule that divided by 0). Its class is the script's."""
    torch.manual_seed(7)
    m = ScriptPolicy()
    opt = torch.optim.Adam(m.q_net.parameters(), lr=1e-3)
    rb = M.ReplayBuffer(128)
    rng = np.random.default_rng(0)
    for _ in range(128):
        o = rng.standard_normal(M.OBS).astype(np.float32)
        rb.add(o, o, np.array([rng.integers(3), 0]), rng.standard_normal(), rng.random() < 0.1)
    rec = FlightRecorder(m, opt, out_dir=out_dir) if record else None
    with rec or contextlib.nullcontext():
        for it in range(10):
            o, a, no, r, d = rb.sample(16)
            with torch.no_grad():
                target_max = m.q_net_target(no).max(dim=1)[0]
                td_target = r.flatten() + 0.99 * target_max * (1 - d.flatten())
            old_val = m(o).gather(1, a[:, :1].long()).squeeze()
            loss = torch.nn.functional.smooth_l1_loss(old_val, td_target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tau = float("nan") if it == bad_tau_at else 0.1
            M.soft_update(m.q_net, m.q_net_target, tau)
    return [m.state_dict()]


def test_a_healthy_dqn_with_its_target_inside_the_recorded_policy_is_silent(tmp_path):
    """The target's in-place Polyak writes (frozen parameters of the recorded model, outside
    any optimizer) and its no_grad calls before the step's forward raise nothing."""
    assert same(dqn(tmp_path), dqn(tmp_path, record=False))
    assert not list(tmp_path.glob("*.nan"))


def test_a_polyak_update_with_a_nan_tau_is_the_loops_update_without_a_factory(tmp_path):
    """The NaN tau of iteration 6 writes NaN into every target weight after step 6's update:
    a ``weights`` event at step 7. Recorded with no factory, of a class the replay cannot
    rebuild, the report still names the loop's own update of frozen parameters the optimizer
    does not hold (the bundle says which are frozen and which it holds); it said 'find what
    writes weights outside optimizer.step() (checkpoint loading, in-place edits)'."""
    with pytest.raises(NonFiniteError) as info:
        dqn(tmp_path, bad_tau_at=6)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (7, "weights", "nan"), ev
    assert ev["params"] == [f"q_net_target.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]
    rep = nanreplay_json(info.value.bundle_path, code=None)
    assert rep["cause"] == "weights", rep["cause"]
    assert "require no gradient and the optimizer does not hold them" in rep["hint"], rep["hint"]
    assert "every element of them is non-finite" in rep["hint"], rep["hint"]
