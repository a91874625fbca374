"""End to end: stable-baselines3 2.9 / gymnasium 1.4 training recorded from an SB3 callback
(``recorder.sb3.FlightRecorderCallback``) around ``model.learn()``. PPO's updates run through
``policy.evaluate_actions`` (no forward of the policy): the callback runs it through the
policy's forward (``through_forward``, which the factories apply too), so they are recorded;
DQN's ``q_net`` and SAC's ``critic`` are recorded in their updates through their forwards,
SAC's actor (``action_log_prob``) is not. Planted: an
env's NaN reading (PPO's Categorical refuses it inside the forward, which SB3 reports to no
callback), a features extractor's ``x / ||x||`` of an all-zero observation, a sqrt-of-energy
gain whose derivative at 0 is infinite (backward only), an unbounded reward under SAC's TD
target (loss computed inline by SAC), and a learning rate that blows DQN's weights up."""

from __future__ import annotations

import pytest
import sb3_rl_models as M
import torch
from bundles import invoke_cli, nanreplay_json, one_error_line, source_line

from recorder import NonFiniteError
from recorder.sb3 import FlightRecorderCallback

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "sb3_rl_models.py"


def learn(model, steps: int, tmp_path, factory: str, **kw):
    """``model.learn`` under the product's callback: the bundle of the event, and its error."""
    cb = FlightRecorderCallback(out_dir=tmp_path, factory=f"sb3_rl_models:{factory}", **kw)
    with pytest.raises(Exception) as err:
        model.learn(steps, callback=cb)
    assert not set(M.GUARDED_METHODS) & set(vars(model)), "the callback left its wrappers"
    bundles = sorted(tmp_path.glob("*.nan"))
    assert len(bundles) == 1, (err.value, bundles)
    return bundles[0], err.value


def test_healthy_dqn_and_ppo_raise_nothing_and_train_bit_identically(tmp_path, caplog):
    def weights(model):
        return {k: v.clone() for k, v in model.policy.state_dict().items()}

    for build, part, factory in ((M.dqn, "q_net", "make_dqn_q_net"),
                                 (M.ppo, "policy", "make_ppo_policy")):
        plain = build()
        plain.learn(96)
        recorded, cb = build(), FlightRecorderCallback(
            part=part, out_dir=tmp_path, factory=f"sb3_rl_models:{factory}")
        recorded.learn(96, callback=cb)
        a, b = weights(plain), weights(recorded)
        assert all(torch.equal(a[k], b[k]) for k in a), part
        assert not list(tmp_path.glob("*.nan"))
        assert cb.recorder.step == {"q_net": 20, "policy": 6}[part]  # (PPO: its minibatches)
    assert cb.recorder is not None and not cb.recorder.health.active
    assert "forward" not in vars(recorded.policy)  # (through_forward undone at detach)
    assert not [r for r in caplog.records if "ran on its own" in r.getMessage()]


def test_ppo_env_nan_observation_is_an_input_event_of_the_rollout(tmp_path):
    """The NaN reading reaches SB3's Categorical inside the policy's forward, which raises
    ValueError before the forward returns; SB3 tells no callback, so the callback's guard of
    ``collect_rollouts`` checks the cut-short rollout forward and writes its bundle."""
    bundle, err = learn(M.ppo(M.ProbeEnv(nan_at=40)), 96, tmp_path, "make_ppo_policy")
    assert isinstance(err, ValueError) and "Bundle:" in err.__notes__[0]
    rep = nanreplay_json(bundle)
    ev, o = rep["event"], rep["origin"]
    assert (ev["step"], ev["phase"], ev["evaluation"]) == (2, "input", True)
    assert (o["module"], o["samples"], rep["cause"]) == (None, [0], "input")
    assert "observations the env returned (sample 0 at feature(s) 2 (of 4))" in rep["hint"]
    assert "VecCheckNan" in rep["hint"] and "genotype" not in rep["hint"]


def test_ppo_features_extractor_divides_a_zero_observation_by_its_norm(tmp_path):
    bundle, err = learn(M.ppo(M.ProbeEnv(zero_at=40), extractor=M.UnitNorm), 96, tmp_path,
                        "make_ppo_unit_norm")
    assert isinstance(err, ValueError)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"]) == (2, "forward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("features_extractor", "aten.div", [0], "invalid")
    assert o["source"] == source_line(MODELS, "x = obs / obs.norm(dim=-1, keepdim=True)")
    assert "all zeros" in rep["hint"]


def test_dqn_sqrt_gain_at_a_zero_observation_is_nan_only_in_the_backward(tmp_path):
    bundle, err = learn(M.dqn(M.ProbeEnv(zero_at=5), extractor=M.RootNorm), 200, tmp_path,
                        "make_dqn_root_norm", part="q_net")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"]) == (0, "backward")
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("features_extractor", "SqrtBackward0", [11], "invalid")
    assert o["source"] == source_line(MODELS, "gain = 1 + torch.sqrt((h * h).mean(")
    assert "batch is 0 everywhere in sample(s) 11" in rep["hint"]


def test_sac_unbounded_reward_names_the_replay_rows_and_sb3s_inline_loss(tmp_path):
    """SAC computes its critic loss inline from the replay batch: the report names the rows
    whose reward overflowed float32 (``inf``), and says where that loss is, not that
    SACPolicy (which holds the critic and computes no loss) should be recorded instead."""
    env = M.ProbeEnv(continuous=True, reward_growth=1e4)
    with pytest.warns(RuntimeWarning, match="overflow"):
        bundle, err = learn(M.sac(env), 200, tmp_path, "make_sac_critic", part="critic")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"], o["phase"]) == (0, "backward", "loss")
    assert (o["tensor"], o["made"], rep["cause"]) == ("grad of the model output 1", "-inf", None)
    assert o["samples"] == [0, 1, 6, 11, 15]
    assert "the replay buffer's rewards" in rep["hint"] and "SACPolicy" not in rep["hint"]


def test_dqn_learning_rate_too_high_overflows_the_next_forward(tmp_path):
    bundle, err = learn(M.dqn(lr=1e30), 200, tmp_path, "make_dqn_q_net", part="q_net")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["event"]["step"], rep["event"]["phase"]) == (1, "forward")
    assert (o["module"], o["op"], rep["cause"]) == ("q_net.2", "aten.addmm", "overflow")
    assert o["all_samples"] is True
    assert "lower the learning rate" in rep["hint"]


def test_ppo_log_std_a_high_learning_rate_blew_up_overflows_exp_in_the_next_update(tmp_path):
    """PPO's minibatch updates are recorded (through_forward): the update at lr=1e4 sent the
    state-independent log_std to ~1e4, and the next minibatch's ``log_std.exp()`` in SB3's
    DiagGaussianDistribution overflows: named with the parameter and the jump before it."""
    bundle, err = learn(M.ppo(M.ProbeEnv(continuous=True), lr=1e4), 200, tmp_path,
                        "make_ppo_cont")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    ev, o = rep["event"], rep["origin"]
    assert (ev["step"], ev["phase"], ev["evaluation"]) == (1, "forward", False)
    assert (o["module"], o["op"], o["made"], rep["cause"]) == \
        ("", "aten.exp", "+inf", "overflow")
    assert o["source"].endswith("distributions.py:165") and o["all_samples"] is True
    assert "the parameter log_std" in rep["hint"] and "lower the learning rate" in rep["hint"]
    assert [p["kind"] for p in rep["precursors"]] == ["weight_jump"]
    # a factory that builds the policy without through_forward: one line naming it
    line = one_error_line(invoke_cli(bundle, "--factory", "sb3_rl_models:make_ppo_cont_plain"))
    assert "call recorder.sb3.through_forward(model) in the factory" in line


def test_sac_actor_update_no_step_closed_is_numbered_and_told_as_unrecorded(tmp_path):
    """SAC updates its actor through action_log_prob, not its forward: no step opens, and the
    update that a learning rate of 100 made the actor NaN with is found by the next rollout
    forward. It was numbered step -1 (the step before the first, a bundle
    ``step-0000001``) and told as 'finite gradients became non-finite weights', which nothing
    checked, with a note to use guard_optimizer, which copies nothing here."""
    bundle, err = learn(M.sac(lr=1e2), 400, tmp_path, "make_sac_actor", part="actor")
    assert isinstance(err, ValueError) and bundle.name == "step00000000-rank0.nan"
    rep = nanreplay_json(bundle, code=1)
    ev, o = rep["event"], rep["origin"]
    assert (ev["step"], ev["phase"], ev["evaluation"], ev["no_step_closed"]) == \
        (0, "optimizer", True, True)
    assert (o["param"], rep["cause"], rep["reproduced"]) == ("latent_pi.0.weight", "optimizer",
                                                             False)
    assert "closed no recorded step" in rep["hint"] and "lr=100:" in rep["hint"]
    assert "finite gradients" not in rep["hint"]
    assert any("with guard_optimizer=True either" in p for p in rep["problems"])


def test_dqn_nan_observation_stored_before_learning_starts_is_an_update_input_event(tmp_path):
    """Before learning_starts DQN acts at random (no forward): the NaN reading goes into the
    replay buffer unseen, and the update that samples it is the event, its row named as a row
    of the sampled batch, not a table's missing value."""
    bundle, err = learn(M.dqn(M.ProbeEnv(nan_at=5)), 400, tmp_path, "make_dqn_q_net",
                        part="q_net")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    ev, o = rep["event"], rep["origin"]
    assert (ev["step"], ev["phase"], ev["evaluation"]) == (0, "input", False)
    assert (o["samples"], rep["cause"]) == ([11], "input")
    assert "(sample 11 at feature(s) 2 (of 4)), in an update, rows of the batch sampled from " \
           "the replay buffer" in rep["hint"]


def test_a_second_learn_numbers_its_steps_on_from_the_updates_before(tmp_path):
    """``learn(reset_num_timesteps=False)`` goes on training: its steps go on from the
    algorithm's update count, so a bundle of the second run is not named as a first run's."""
    model = M.dqn(M.ProbeEnv(zero_at=70), extractor=M.RootNorm)
    cb = FlightRecorderCallback(part="q_net", out_dir=tmp_path,
                                factory="sb3_rl_models:make_dqn_root_norm")
    model.learn(48, callback=cb)
    assert model._n_updates == cb.recorder.step == 8 and not list(tmp_path.glob("*.nan"))
    with pytest.raises(NonFiniteError) as err:
        model.learn(400, callback=cb, reset_num_timesteps=False)
    rep = nanreplay_json(err.value.bundle_path)
    assert (rep["event"]["step"], rep["event"]["phase"], rep["origin"]["op"]) == \
        (13, "backward", "SqrtBackward0")


def test_ppo_unbounded_reward_enters_through_the_value_loss_sb3_computed_inline(tmp_path):
    """The rollout's returns overflow (rewards 1e4 ** t, inf in float32), PPO's value loss
    F.mse_loss(returns, values) sends NaN into the value head's output, all rows (the
    advantages are normalised over the minibatch): the loss SB3 computed inline, said so."""
    with pytest.warns(RuntimeWarning):
        bundle, err = learn(M.ppo(M.ProbeEnv(reward_growth=1e4)), 96, tmp_path,
                            "make_ppo_policy")
    assert isinstance(err, NonFiniteError)
    rep = nanreplay_json(bundle)
    ev, o = rep["event"], rep["origin"]
    assert (ev["step"], ev["phase"], o["phase"], o["tensor"]) == \
        (0, "backward", "loss", "grad of the model output 0")
    assert (o["all_samples"], rep["cause"]) == (True, None)
    assert "advantages and returns of the rollout buffer" in rep["hint"]


def test_a_network_without_an_optimizer_of_its_own_is_refused_in_one_line(tmp_path):
    """SACPolicy holds no optimizer (its actor and critic each hold one): said at
    learn()'s start, naming an attribute that does."""
    cb = FlightRecorderCallback(part="policy", out_dir=tmp_path)
    with pytest.raises(AttributeError, match=r"optimizer='policy.optimizer': SAC has no "
                                             r"attribute .*e\.g\. 'critic\.optimizer'"):
        M.sac().learn(8, callback=cb)
