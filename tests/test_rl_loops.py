"""End to end: a PPO update whose loss the loop computes itself (no ``loss_fn``), clipped with
``clip_grad_norm_`` as RL code always does. Its minibatch of one sample makes the advantage
normalisation ``(a - a.mean()) / a.std()`` NaN (``std`` of one value), which reaches only the
actor head's gradient; the loop's clip then multiplies every gradient, the critic's too, by
the NaN total norm. The replay must call that reproduced, name where it entered and say the
rest was spread after backward."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import rl_models as RL
import torch
from bundles import invoke_cli
from torch import nn
from torch.distributions import Categorical

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

T, ENVS = 8, 4  # rollout length, parallel environments: 32 samples an update


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def rollout(agent, g):
    """Observations, actions, their log-probabilities and advantages, sampled with no_grad in
    train mode, as PPO's collection loop does."""
    obs = torch.randn(T * ENVS, RL.OBS, generator=g)
    with torch.no_grad():
        logits, _ = agent(obs)
        d = Categorical(logits=logits)
        act = torch.multinomial(d.probs, 1, generator=g)[:, 0]  # (d.sample takes no generator)
        logp = d.log_prob(act)
    adv = torch.randn(T * ENVS, generator=g)
    return obs, act, logp, adv


def ppo_update(agent, opt, obs, act, logp, adv, mb: int):
    for start in range(0, len(obs), mb):
        i = slice(start, start + mb)
        logits, value = agent(obs[i])
        d = Categorical(logits=logits)
        ratio = (d.log_prob(act[i]) - logp[i]).exp()
        a = adv[i]
        a = (a - a.mean()) / (a.std() + 1e-8)  # NaN for a minibatch of one
        pg = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
        loss = pg - 0.01 * d.entropy().mean() + 0.5 * (value.squeeze(-1) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        opt.step()


def test_a_nan_spread_by_the_loops_clip_is_reproduced(tmp_path):
    agent = RL.make_agent()
    opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std()'s "degrees of freedom is <= 0"
        with FlightRecorder(agent, opt, out_dir=tmp_path, factory="rl_models:make_agent"):
            for update in range(3):
                ppo_update(agent, opt, *rollout(agent, g), mb=1 if update == 2 else 16)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "backward")  # 2 updates of 2
    r = invoke_cli(err.bundle_path, "--json")
    rep = json.loads(r.stdout)
    assert rep["reproduced"] is True and r.exit_code == 0, json.dumps(rep, indent=1)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["made"], o["samples"]) == ("loss", "<loss>", "nan", [0])
    assert o["tensor"] == "grad of the model output 0"  # the actor's logits, not the value
    assert sorted(o["params"]) == ["actor.0.bias", "actor.0.weight", "actor.2.bias",
                                   "actor.2.weight"]
    [note] = [p for p in rep["problems"] if "spread" in p]
    assert note.startswith("4 more parameters had non-finite gradients in the recording "
                           "(critic.0.weight, critic.0.bias, critic.2.weight (+1 more))"), note
    assert "clip_grad_norm_" in note


def reinforce_episode(policy, opt, rewards: list[float]) -> None:
    """One episode of pytorch/examples' REINFORCE: a forward per observation with an action
    sampled (from the global RNG) after each, then returns normalised by their std, here
    without its eps: an episode whose rewards are all 0 makes them 0/0."""
    log_probs = []
    for _ in rewards:
        m = Categorical(policy(torch.randn(1, RL.OBS)))
        log_probs.append(m.log_prob(m.sample()))
    returns, r = [], 0.0
    for reward in reversed(rewards):
        r = reward + 0.99 * r
        returns.insert(0, r)
    ret = torch.tensor(returns)
    ret = (ret - ret.mean()) / ret.std()
    opt.zero_grad()
    torch.cat([-lp * g for lp, g in zip(log_probs, ret)]).sum().backward()
    opt.step()


def reinforce_bundle(out_dir: Path, **settings) -> dict:
    """The event of four REINFORCE episodes of six forwards each, the fourth without reward."""
    torch.manual_seed(0)
    policy = RL.make_dropout_policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(policy, opt, out_dir=out_dir, factory="rl_models:make_dropout_policy",
                           **settings):
        for episode in range(4):
            reinforce_episode(policy, opt, [0.0] * 6 if episode == 3 else [0.0] * 5 + [1.0])
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "backward")
    return err.bundle_path


def test_actions_sampled_between_forwards_do_not_change_the_replayed_dropout(tmp_path):
    """Each forward of the episode is a micro-batch of one step, and the loop draws from the
    RNG between them: the replay must restore the state each forward began with, or every
    dropout mask after the first differs (the fidelity check then blamed other weights)."""
    bundle = reinforce_bundle(tmp_path)
    r = invoke_cli(bundle, "--json")
    rep = json.loads(r.stdout)
    assert rep["fidelity"]["matches"] is True, rep["fidelity"]
    # each later forward keeps the generators that drew since the one before: torch's alone
    meta, _ = read_bundle(bundle)
    assert meta["micro_batches"][2]["rng"]["keys"] == {"torch_cpu": "rng/mb/2/torch_cpu"}
    assert rep["reproduced"] is True and r.exit_code == 0, json.dumps(rep, indent=1)
    assert (rep["origin"]["phase"], rep["origin"]["module"]) == ("loss", "<loss>")


def test_a_window_feeds_the_nan_that_entered_from_the_loops_loss(tmp_path):
    """No ``loss_fn``: the loop's loss sent NaN into the model output. The window's faithful
    re-run must back-propagate that recorded gradient as training did (it left it out, ran
    finite and said the event did not come back), and a try that cannot change it (the
    learning rate) must not be reported as a fix."""
    r = invoke_cli(reinforce_bundle(tmp_path, rewind=2), "--json", "--try", "lr=0.1x")
    rep = json.loads(r.stdout)
    win = rep["window"]
    assert win["reproduced"] is True, json.dumps(win, indent=1)
    assert (win["first_non_finite"]["step"], win["first_non_finite"]["phase"]) == (3, "backward")
    [t] = rep["what_if"]
    assert (t["finite"], t["inconclusive"], t["origin"]["step"]) == (False, False, 3), t


def test_a_dqn_target_made_infinite_by_a_reward_comes_back_in_the_window(tmp_path):
    """A DQN (the PyTorch tutorial's: a target network synced by ``load_state_dict``, the
    TD target built from it under ``no_grad``, ``SmoothL1Loss`` on the gathered Q-values): a
    transition whose reward is ``1 / distance`` at distance 0 (+inf) is replayed from memory.
    The recorder's event is an input event on that loss argument; the window's re-run met
    the same +inf in the same target and must say the event came back (it said the first
    non-finite value, the loss, was not the recorded event)."""
    torch.manual_seed(0)
    q_net, target_net = RL.make_qnet(), RL.make_qnet()
    opt = torch.optim.AdamW(q_net.parameters(), lr=1e-3, amsgrad=True)
    crit = nn.SmoothL1Loss()
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(64, RL.OBS, generator=g)
    acts = torch.randint(0, RL.ACT, (64,), generator=g)
    rewards = torch.rand(64, generator=g)
    rewards[5] = 1.0 / torch.tensor(0.0)  # the goal reached: distance 0
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(q_net, opt, loss_fn=crit, out_dir=tmp_path, rewind=4,
                           factory="rl_models:make_qnet"):
        for t in range(12):
            i = torch.arange(8, 16) + 8 * (t % 6) if t < 10 else torch.tensor([0, 5, 9, 12])
            q = q_net(obs[i]).gather(1, acts[i, None])
            with torch.no_grad():
                target = rewards[i] + 0.99 * target_net(obs[i]).max(1).values
            loss = crit(q, target.unsqueeze(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if t % 4 == 0:
                target_net.load_state_dict(q_net.state_dict())
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (10, "input")
    r = invoke_cli(err.bundle_path, "--json", "--try", "auto")
    rep = json.loads(r.stdout)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [1]), json.dumps(rep, indent=1)
    win = rep["window"]
    assert win["reproduced"] is True, json.dumps(win, indent=1)
    assert (win["first_non_finite"]["step"], win["first_non_finite"]["phase"]) == (10, "input")
    [t] = rep["what_if"]
    assert (t["try"], t["finite"], t["inconclusive"]) == ("drop=1", True, False), t


def test_a_rollout_cut_short_before_its_loss_does_not_say_the_loss_was_called_directly(
        tmp_path):
    """A recurrent A2C steps its policy once per environment step, with gradients, and calls
    its loss through ``rec.loss_fn`` once the rollout is over. A NaN observation makes the
    next forward's logits NaN, and ``Categorical`` refuses them: the loop raises mid-rollout,
    before the loss. The recorder's note on that exception must name the input, not claim
    that the loss function was called without ``rec.loss_fn`` (the loss never ran)."""
    torch.manual_seed(0)
    policy = RL.make_recurrent_policy()
    opt = torch.optim.RMSprop(policy.parameters(), lr=7e-4, eps=1e-5)
    h, masks = torch.zeros(8, 16), torch.ones(8, 1)
    with pytest.raises(ValueError) as info, \
            FlightRecorder(policy, opt, loss_fn=RL.a2c_loss, out_dir=tmp_path,
                           factory="rl_models:make_recurrent_policy") as rec:
        for update in range(4):
            h, out = h.detach(), []
            for t in range(5):
                obs = torch.randn(8, RL.OBS)
                if (update, t) == (3, 2):
                    obs[5, 1] = float("nan")  # a sensor glitch in environment 5
                logits, v, h = policy(obs, h, masks)
                a = Categorical(logits=logits.detach(), validate_args=True).sample()  # NaN: raises
                out.append((logits, v, a, (a == 0).float()))
                masks = (torch.rand(8, 1) > 0.1).float()
            loss = rec.loss_fn(*(torch.stack(x) for x in zip(*out)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    [note] = [n for n in getattr(info.value, "__notes__", []) if "nanreplay" in n]
    assert "at step 3, phase input" in note and "samples [5]" in note, note
    assert "rec.loss_fn" not in note, note


def test_a_tanh_squashed_log_prob_correction_rounded_to_log_0_is_precision(tmp_path):
    """SAC's log-probability correction written ``log(1 - tanh(u)²)`` without its eps: once
    observations leave their normalised range the pre-squash action u is large, tanh(u) rounds
    to 1.0 (in float64 too, past u ≈ 19) and the log takes 0. Exact arithmetic keeps
    1 - tanh(u)² above 0 for every finite u, so the cause is rounding, ``precision``, with
    the stable form as the hint (it said ``invalid``: 'exact arithmetic makes it too')."""
    torch.manual_seed(0)
    actor = RL.make_squashed_actor()
    opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    crit = RL.SquashedActorLoss()
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(actor, opt, loss_fn=crit, out_dir=tmp_path,
                           factory="rl_models:make_squashed_actor"):
        for step in range(6):
            obs = torch.randn(32, RL.OBS) * (200.0 if step == 4 else 1.0)
            loss = crit(actor(obs), torch.randn(32, 2))
            opt.zero_grad()
            loss.backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (4, "loss")
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.log", "-inf", "precision"), \
        json.dumps(rep, indent=1)
    assert "2·(log 2 − u − softplus(−2u))" in rep["hint"], rep["hint"]


def drifting_log_std_bundle(out_dir: Path) -> Path:
    """A Gaussian policy's ``log_std`` parameter drifts down by the learning rate each update
    (an entropy bonus of the wrong sign), from -40 where a long run left it: ``Normal``'s
    variance ``exp(log_std) ** 2`` falls below float32's range and its ``(x - mu)² / (2 var)``
    has an infinite gradient."""
    torch.manual_seed(0)
    policy = RL.make_gaussian_policy()
    with torch.no_grad():
        policy.log_std.fill_(-40.0)
    opt = torch.optim.Adam([{"params": [*policy.mu.parameters(), *policy.v.parameters()]},
                            {"params": [policy.log_std], "lr": 1.0}], lr=3e-4)
    with pytest.raises(NonFiniteError) as info, \
            FlightRecorder(policy, opt, loss_fn=RL.gaussian_a2c_loss, out_dir=out_dir,
                           factory="rl_models:make_gaussian_policy") as rec:
        for _ in range(30):
            obs = torch.randn(32, RL.OBS)
            with torch.no_grad():  # the rollout's actions, sampled as PPO's collection does
                mu, log_std, _ = policy(obs)
                action = mu + log_std.exp() * torch.randn_like(mu)
            loss = rec.loss_fn(policy(obs), action, torch.zeros(32))  # (no reward yet)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert info.value.event["phase"] == "backward"
    return info.value.bundle_path


def test_a_gaussian_variance_from_a_drifting_log_std_is_an_underflow(tmp_path):
    """The variance is positive in exact arithmetic (a power of exp, times 2): ``underflow``,
    not rounding across a domain edge (it said ``precision``)."""
    rep = json.loads(invoke_cli(drifting_log_std_bundle(tmp_path), "--json").stdout)
    o = rep["origin"]
    assert (o["phase"], o["op"], rep["cause"]) == ("backward", "DivBackward0", "underflow"), \
        json.dumps(rep, indent=1)


def test_a_parameter_edited_between_the_forward_and_the_loss_is_named_not_the_factory(
        tmp_path):
    """A continuous PPO loop anneals exploration by writing the policy's log std in place
    after the forward returned its view: the variance underflows and the gradients go NaN.
    The bundle holds the edited weight, the re-run's forward differs from the recording, and
    the report blamed the factory ("builds a different model"). The weight's norm against the
    one the last update left shows it was written outside ``optimizer.step()``: the fidelity
    line names the parameter and the edit."""
    actor = RL.make_gaussian_actor()
    opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(actor, opt, out_dir=tmp_path,
                            factory="rl_models:make_gaussian_actor"):
            for step in range(6):
                obs = torch.randn(32, RL.OBS, generator=g)
                act = torch.randn(32, RL.ACT, generator=g)
                adv = torch.randn(32, generator=g)
                opt.zero_grad()
                mean, log_std = actor(obs)
                if step == 3:
                    with torch.no_grad():
                        actor.log_std.fill_(-60.0)  # BUG: anneals through the forward's view
                var = torch.exp(2 * log_std)  # 0 in float32 at log std -60
                logp = (-0.5 * (act - mean) ** 2 / var - log_std).sum(-1)
                (-(logp * adv).mean()).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "backward")
    res = invoke_cli(info.value.bundle_path, "--json")
    rep = json.loads(res.stdout)
    fid = rep["fidelity"]
    assert fid["matches"] is False and fid["edited"] == ["log_std"], fid
    assert rep["reproduced"] is False and res.exit_code == 1
    assert "factory builds a different model" not in res.stdout, rep
    text = invoke_cli(info.value.bundle_path).stdout
    assert "parameter log_std differs from what the last optimizer.step() left" in text, text


def test_an_underflow_of_a_drifting_log_std_names_that_parameter(tmp_path):
    """The same run: the value that underflowed is exp of the policy's ``log_std`` parameter,
    so the hint must name it and say to bound it (it said only to compute in log space or
    clamp the value away from 0, a fix to Normal's formula, which is not the bug)."""
    rep = json.loads(invoke_cli(drifting_log_std_bundle(tmp_path), "--json").stdout)
    assert rep["cause"] == "underflow", json.dumps(rep, indent=1)
    assert "the exp of the parameter log_std (as low as -4" in rep["hint"], rep["hint"]
    assert "log_std.clamp(min=-20)" in rep["hint"], rep["hint"]
