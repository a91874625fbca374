"""End to end: cooperative multi-agent RL as PyMARL, EPyMARL and MAPPO write it. QMIX (one
GRU agent network shared by the agents, agent-id and last-action one-hots, the monotonic
hypernetwork mixer, double-Q TD(lambda) targets over padded episodes from a target copy,
RMSprop, gradient clipping) and MAPPO (recurrent actor with available-action masks before
``Categorical``, a centralised critic, ``ValueNorm``, GAE, the clipped surrogate as a loss
module), each over a ``DataLoader`` of episodes. Planted: a NaN in the global state, the
optimizer's eps at 0, a ``-inf`` action mask meeting a dead agent, a stale available-action
mask behind the behaviour log-probs, ``E[x^2] - E[x]^2`` without its clamp, the joint
action's probability as a product, an entropy over available actions masked after the log."""

from __future__ import annotations

import contextlib
import copy

import multi_agent_rl_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "multi_agent_rl_models.py"


def qmix(out_dir, record=True, steps=8, opt_eps=1e-5, nan_state=None):
    """PyMARL's QLearner: sample episodes, one forward (the mixed Q of the taken actions and
    every agent's Qs, detached for double Q), TD(lambda) targets from the target copy, the
    masked TD loss, clip 10, RMSprop; the target copied every 4 updates."""
    model = M.make_qmix()
    target = copy.deepcopy(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-4, alpha=0.99, eps=opt_eps)
    loader = DataLoader(M.EpisodeBuffer(16), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    rec = FlightRecorder(model, opt, loss_fn=M.masked_td_loss, out_dir=out_dir,
                         factory="multi_agent_rl_models:make_qmix") if record else None
    step = 0
    with rec or contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec else M.masked_td_loss
        while step < steps:
            for batch in loader:
                if step == nan_state:
                    batch["state"][2, 1, 4] = float("nan")  # the env's state vector lost a unit
                q_tot, qs = model(batch["obs"], batch["last_actions"], batch["state"],
                                  batch["actions"])
                with torch.no_grad():
                    targets = M.qmix_targets(qs.detach(), target, batch)
                loss = loss_fn(q_tot, targets, batch["filled"])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                step += 1
                if step % 4 == 0:
                    target.load_state_dict(model.state_dict())
                if step == steps:
                    break
    return model.state_dict()


class Rollout(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data["obs"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


def mappo(out_dir, factory="make_mappo", record=True, epochs=2, loss_kw=None, dead_noop=True,
          stale_avail=False, returns_offset=0.0, normalise_adv=False):
    """MAPPO's runner and trainer: the rollout's log-probs from the policy itself under
    no_grad (``collect``), then PPO epochs over shuffled minibatches of episodes, the value
    normaliser updated with each minibatch's returns before its loss, clip 10, Adam."""
    policy = getattr(M, factory)()
    criterion = M.MAPPOLoss(**(loss_kw or {}))
    opt = torch.optim.Adam(policy.parameters(), lr=5e-4, eps=1e-5)
    data = M.mappo_batch(dead_only_noop=dead_noop)
    data["returns"] = data["returns"] + returns_offset
    if normalise_adv:  # MAPPO's advantage normalisation over the active entries
        adv, live = data["adv"], data["active"] > 0
        data["adv"] = (adv - adv[live].mean()) / (adv[live].std() + 1e-5)
    rec = FlightRecorder(policy, opt, loss_fn=criterion, out_dir=out_dir,
                         factory=f"multi_agent_rl_models:{factory}") if record else None
    with rec or contextlib.nullcontext():
        with torch.no_grad():
            avail = data["avail"]
            if stale_avail:  # the buffer's avail written one step late: the next step's
                avail = torch.cat([avail[:, 1:], avail[:, -1:]], 1)
            data["old_logp"] = policy(data["obs"], data["state"], avail, data["actions"])[0]
        loader = DataLoader(Rollout(data), batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        for _ in range(epochs):
            for mb in loader:
                criterion.value_norm.update(mb["returns"])
                logp, probs, ent, values = policy(mb["obs"], mb["state"], mb["avail"],
                                                  mb["actions"])
                loss = criterion(logp, probs, ent, values, mb["old_logp"], mb["adv"],
                                 mb["returns"], mb["active"], mb["avail"])
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
                opt.step()
    return policy.state_dict()


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_healthy_qmix_and_mappo_runs_are_silent_and_bit_identical(tmp_path):
    """Dead agents with only the no-op, padded episodes, the -1e10 action fill, the clamped
    ValueNorm: no event, no bundle, the same weights as without the recorder."""
    assert same(qmix(tmp_path), qmix(tmp_path, record=False))
    assert same(mappo(tmp_path), mappo(tmp_path, record=False))
    assert same(mappo(tmp_path, normalise_adv=True), mappo(tmp_path, normalise_adv=True,
                                                           record=False))
    assert not list(tmp_path.glob("*.nan"))


def test_a_nan_in_the_global_state_is_the_mixers_input(tmp_path):
    """The environment's state vector of episode 2 lost a unit at update 3: an input event
    on the state argument, that episode alone."""
    with pytest.raises(NonFiniteError) as info:
        qmix(tmp_path, nan_state=3)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[2]", [2])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "input" and rep["reproduced"] is True
    assert rep["origin"]["samples"] == [2]


def test_rmsprop_without_eps_is_an_optimizer_event_naming_eps(tmp_path):
    """``optim_eps=0``: fc1's rows of hidden units no episode activates get a gradient of
    exactly 0, square_avg 0, and 0/0 in the first update."""
    with pytest.raises(NonFiniteError) as info:
        qmix(tmp_path, opt_eps=0.0)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(info.value.bundle_path, code=1)
    assert rep["cause"] == "optimizer"
    assert "RMSprop" in rep["hint"] and "eps=0" in rep["hint"] and "agent.fc1.weight" in rep["hint"]


@pytest.fixture
def unvalidated():
    """``Distribution.set_default_validate_args(False)``, as RL code sets it for speed."""
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(True)


def test_an_inf_action_mask_meeting_a_dead_agent_names_the_mask_not_padding(tmp_path, unvalidated):
    """Logits filled with -inf, and an environment that marks no action available for a dead
    agent: the rollout's no_grad forward (before step 0) is NaN in ``actor.act`` on exactly the
    episodes with a dead agent. The hint names the available-action mask's all-0 rows (the
    generic fully-masked-row advice named no input; with every agent's action 0 at such a step,
    those ids were taken for padding units of a document)."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, factory="make_mappo_inf_mask", dead_noop=False)
    ev = info.value.event
    dead = [0, 1, 2, 3, 4, 5, 7]  # (episode 6's agents all live through the window)
    assert (ev["step"], ev["phase"], ev["module"], ev["evaluation"]) == \
        (0, "forward", "actor.act", True)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert (o["module"], o["op"], o["samples"]) == ("actor.act", "aten.logsumexp", dead)
    assert o["source"] == source_line(MODELS, "return Categorical(logits=logits)")
    assert "(a fully masked row)" in rep["hint"]
    assert "rows of args[2], a 0/1 mask" in rep["hint"] and "mark the no-op available" in rep["hint"]
    assert "sample 0, at (1, 1), (2, 1), (3, 1) ..." in rep["hint"], rep["hint"]


def test_a_stale_action_mask_behind_the_behaviour_log_probs_overflows_the_ratio(tmp_path):
    """The rollout's log-probs taken with the next step's avail: an action of an agent that
    died at the next step gets -1e10, and the update's ``exp(logp - old_logp)`` is +inf on
    those episodes; the clipped surrogate keeps it finite, its backward does not. The hint
    names the fill in the stored log-probs (once: clamp the exponent, lower the learning rate)."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, stale_avail=True)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["cause"] == "overflow" and rep["reproduced"] is True
    assert (o["op"], o["module"], o["samples"]) == ("ExpBackward0", "<loss>", [0, 1, 2])
    assert o["source"] == source_line(MODELS, "ratio = torch.exp(logp - old_logp)")
    hint = rep["hint"]
    assert "whose subtracted operand holds -1e+10 at the 4 entries that overflowed" in hint, hint
    assert "another mask than this update's" in hint and "lower learning rate" in hint
    assert "subtract the row max" not in hint


def test_with_normalised_advantages_the_stale_mask_makes_the_loss_infinite(tmp_path):
    """MAPPO's advantage normalisation gives those episodes negative advantages: the clipped
    surrogate's min keeps -inf, the loss is +inf (a loss event), and the loss's exp gets the
    same hint as the backward node that saved its +inf."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, stale_avail=True, normalise_adv=True)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["cause"] == "overflow" and rep["reproduced"] is True
    assert (o["op"], o["module"], o["samples"]) == ("aten.exp", "<loss>", [0, 1, 2])
    assert "whose subtracted operand holds -1e+10" in rep["hint"], rep["hint"]


def test_valuenorm_without_its_variance_clamp_is_precision_in_the_loss(tmp_path):
    """Returns of about 3000 (unscaled rewards): E[x^2] - E[x]^2 of the float32 running
    statistics is -1 after the first update, sqrt is NaN in the loss's ValueNorm."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, loss_kw={"clamp_var": False}, returns_offset=3000.0)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["cause"] == "precision" and rep["reproduced"] is True
    assert (o["op"], o["module"]) == ("aten.sqrt", "<loss>")
    assert o["source"] == source_line(MODELS, "return (x - mean) / torch.sqrt(var)")
    assert "E[x²] − E[x]²" in rep["hint"] and "clamp" in rep["hint"]


def test_a_joint_action_probability_as_a_product_underflows_without_blaming_the_data(tmp_path):
    """A policy converged to the no-op (its other actions about exp(-40) each): a step where all
    three agents explored has a joint probability of 7e-53, 0 in float32, and its log -inf in
    the actor. The rollout's old log-probs hold the same -inf (no event: an evaluation output);
    that loss argument's -inf is no record out of scale, which the hint once said it was."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, factory="make_mappo_joint")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (0, "forward", "actor", [0])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["cause"] == "underflow" and rep["reproduced"] is True
    assert (o["op"], o["module"], o["samples"]) == ("aten.log", "actor", [0])
    assert o["source"] == source_line(MODELS, "return torch.log(taken.prod(dim=-1))")
    assert "product of 3 nonzero factors" in rep["hint"] and "sum the factors' logs" in rep["hint"]
    assert "out of scale" not in rep["hint"]


def test_an_entropy_masked_after_its_log_is_a_backward_only_nan(tmp_path):
    """``(p * p.log()).masked_fill(~avail, 0)``: finite forward, but a dead agent's masked
    actions have p = 0 exactly, and the backward of the product takes 0 * log(0). The hint
    says a mask after the log does not keep its gradient finite (once only the log-space
    advice of an underflow)."""
    with pytest.raises(NonFiniteError) as info:
        mappo(tmp_path, loss_kw={"entropy": "masked_plogp"})
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "underflow"
    assert (o["op"], o["module"], o["samples"]) == ("MulBackward0", "<loss>", [0, 1, 2, 3])
    assert o["source"] == source_line(MODELS, "plogp = (probs * probs.log()).masked_fill(")
    assert "made by aten.log" in rep["hint"] and "log_softmax instead of log(softmax)" in rep["hint"]
    assert "masked_fill still send the gradient through both branches" in rep["hint"]
