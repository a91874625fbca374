"""DreamerV3 trained as its PyTorch ports train it (``world_models_models``): the world model's
observation of replay-buffer sequences is the recorded forward, its loss ``loss_fn``; the
actor and critic learn from imagined rollouts with optimizers of their own, stepped after the
world model's in the same iteration, and the slow critic follows the critic by EMA. Healthy:
float32 and float16 AMP with a GradScaler per optimizer, recorded on either optimizer. Planted:
a return scale without its max(1, range) floor on a sparse-reward task, KL taken of one-hot
samples, a confident posterior without unimix, Adam's eps=0 on the zero-initialised critic,
symexp of a diverged critic; each recorded on one optimizer or another, as a user would try."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import world_models_models as W
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

MODELS = "world_models_models.py"
ACTOR = ["actor.0.weight", "actor.0.bias", "actor.1.weight", "actor.1.bias", "actor.3.weight",
         "actor.3.bias"]
CRITIC_HIDDEN = ["critic.0.weight", "critic.0.bias", "critic.1.weight", "critic.1.bias"]


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def update(opt, scaler, loss, params, clip: float, guard: bool = False) -> None:
    """dreamerv3-torch's ``Optimizer.__call__``: zero, (scaled) backward, unscale, clip,
    step (skipped by the scaler on an overflowed gradient), update the scale; with ``guard``,
    no step on a non-finite gradient norm, as JAX Dreamer's optimizer skips one."""
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = nn.utils.clip_grad_norm_(params, clip)
    if not guard or torch.isfinite(norm):
        scaler.step(opt)
    scaler.update()


def train(out_dir: Path | None, steps: int = 4, *, recorded: str = "wm", floor: bool = True,
          critic_eps: float = 1e-5, loss=W.WorldModelLoss, actor_recorder: bool = False,
          amp: bool = False, make: str = "make_agent", guard: bool = False,
          sparse_steps: int = 99, behavior=W.behavior_losses) -> W.Agent:
    """dreamerv3-torch's iteration: the world model's update, then the actor's and critic's
    on a rollout imagined from its posterior states, then the slow critic's EMA; with ``amp``,
    under float16 autocast with a GradScaler per optimizer. With ``out_dir``, under a recorder
    on the agent given the ``recorded`` optimizer (and, with ``actor_recorder``, a second one
    on the actor given the actor's)."""
    agent = getattr(W, make)()
    parts = {"wm": agent.wm, "actor": agent.actor, "critic": agent.critic}
    opts = {"wm": torch.optim.Adam(agent.wm.parameters(), lr=1e-4, eps=1e-8),
            "actor": torch.optim.Adam(agent.actor.parameters(), lr=3e-5, eps=1e-5),
            "critic": torch.optim.Adam(agent.critic.parameters(), lr=3e-5, eps=critic_eps)}
    scalers = {k: torch.amp.GradScaler("cpu", enabled=amp) for k in opts}
    crit, norm, recs = loss(), W.ReturnNorm(floor=floor), []
    if out_dir is not None:
        recs.append(FlightRecorder(agent, opts[recorded], loss_fn=crit, out_dir=out_dir,
                                   scaler=scalers[recorded] if amp else None,
                                   factory=f"world_models_models:{make}").attach())
        crit = recs[0].loss_fn
    if actor_recorder:
        recs.append(FlightRecorder(agent.actor, opts["actor"], out_dir=out_dir / "actor",
                                   factory="world_models_models:make_actor").attach())
    torch.manual_seed(1)
    try:
        for step in range(steps):
            obs, action, reward, is_first, cont = W.sequences(step, sparse=step < sparse_steps)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = agent(obs, action, is_first)
                losses = {"wm": crit(out, obs, reward, cont)}
            update(opts["wm"], scalers["wm"], losses["wm"], parts["wm"].parameters(), 1000.0)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                losses["actor"], losses["critic"] = behavior(agent, out["feat"], norm)
            for k in ("actor", "critic"):
                update(opts[k], scalers[k], losses[k], parts[k].parameters(), 100.0, guard)
            W.update_slow(agent)
    finally:
        for rec in reversed(recs):
            rec.detach()
    return agent


def event_of(out_dir: Path, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, **kw)
    return info.value


def test_healthy_dreamer_raises_no_event_and_trains_bit_identically(tmp_path):
    """Sparse rewards (every return exactly 0 at first: the zero-initialised reward and critic
    heads) under the max(1, range) floor, 1% unimix, free bits, three optimizers and two
    recorders (the agent's on the world model's Adam, the actor's on its own): no event, and
    the weights every optimizer and the EMA left are those of the run without recorders."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no recorder warning either)
        recorded = train(tmp_path, actor_recorder=True)
    plain = train(None)
    assert list(tmp_path.rglob("*.nan")) == []
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recorded", ["wm", "actor"])
def test_healthy_amp_run_with_a_scaler_per_optimizer_raises_no_event(tmp_path, recorded):
    """float16 autocast, a GradScaler per optimizer as dreamerv3-torch keeps them. Recorded on
    the world model's Adam: the critic's scaler finds its first scaled gradients overflowed
    and skips its update, leaving them inf until its next zero_grad, after the world model's
    step has closed the next step. Recorded on the actor's: the world model's overflowed in
    the same step, and its scaler skipped them. Either was read as the step's backward event
    in a run that trains fine, though the recorded update does not use them. No event now,
    and the weights are those of the run without the recorder."""
    out = train(tmp_path, steps=3, amp=True, recorded=recorded)
    plain = train(None, steps=3, amp=True)
    assert list(tmp_path.rglob("*.nan")) == []
    for (name, a), b in zip(out.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(p).all() for p in plain.parameters())


def test_another_optimizers_skipped_nan_gradient_is_no_event_of_the_next_step(tmp_path):
    """No AMP; the actor's update skips a non-finite gradient norm. Step 0's zero return range
    (no floor; the first reward comes at step 1) gives the actor NaN gradients, whose update
    it skips; they stay until its next
    zero_grad, after the world model's step 1 has closed. They are no gradient of step 1's
    backward: no event, and the run matches the one without the recorder."""
    out = train(tmp_path, steps=3, floor=False, guard=True, sparse_steps=1)
    plain = train(None, steps=3, floor=False, guard=True, sparse_steps=1)
    assert list(tmp_path.rglob("*.nan")) == []
    for (name, a), b in zip(out.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    # (the first reward came at step 1: the actor trained from then on, finite)
    assert not torch.equal(out.actor[0].weight, W.make_agent().actor[0].weight)
    assert all(torch.isfinite(p).all() for p in out.parameters())


def test_return_range_of_zero_without_the_floor_is_named_as_another_optimizers(tmp_path):
    """Every imagined return is exactly 0 at step 0, so the 5th-95th percentile range is 0 and
    the advantages 0/0: the actor's Adam, which the recorder on the world model's does not
    hold, writes NaN into the actor. The next step names those weights, reproduced, and says
    another optimizer wrote them."""
    err = event_of(tmp_path, floor=False)
    assert (err.event["step"], err.event["phase"]) == (1, "weights")
    assert err.event["params"] == ACTOR
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "weights"
    assert rep["origin"]["params"] == ACTOR
    assert "another optimizer's step() wrote them" in rep["hint"]


def test_return_range_of_zero_recorded_on_the_actor_enters_from_the_loops_loss(tmp_path):
    """The same bug under the recorder the hint above asks for, on the actor and its Adam:
    each of the rollout's 5 actor calls is a micro-batch; the NaN entered the first one's
    output gradient from the loop's actor loss, on every imagined start state (B * T = 24)."""
    err = event_of(tmp_path, floor=False, actor_recorder=True)
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    assert Path(err.bundle_path).parent == tmp_path / "actor"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True
    assert (o["phase"], o["tensor"], o["micro_batch"], o["made"]) == \
        ("loss", "grad of the model output", 0, "nan")
    assert o["samples"] == list(range(24))


def test_kl_of_one_hot_samples_names_the_log_of_zero(tmp_path):
    """KL balancing taken of the posterior's straight-through one-hot sample instead of its
    probabilities: log(0) of every sample's zeros, then 0 * inf. A loss event at step 0 whose
    op, line and samples the replay names."""
    err = event_of(tmp_path, loss=W.SampledKLLoss)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (o["op"], o["module"], o["made"]) == ("aten.log", "<loss>", "-inf")
    assert o["source"].startswith(source_line(MODELS, "(p * (torch.log(p) - torch.log(q)))"))
    assert o["samples"] == [0, 1, 2, 3]


def test_confident_posterior_without_unimix_is_an_underflow_not_outlying_data(tmp_path):
    """Without DreamerV3's 1% unimix, a confident posterior's softmax rounds its small
    probabilities to exactly 0 (4.7e-60 in float64), whose log the KL takes: an underflow, not
    an invalid log of a true 0. The sparse task's rewards are all 0, and the report used to
    add that samples 0 and 1 of them 'reach 0, the other rows being 0: out of scale'."""
    err = event_of(tmp_path, steps=1, make="make_agent_without_unimix")
    assert (err.event["step"], err.event["phase"]) == (0, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True and rep["cause"] == "underflow"
    assert (o["op"], o["made"]) == ("aten.log", "-inf")
    assert o["source"].startswith(source_line(MODELS, "(p * (torch.log(p) - torch.log(q)))"))
    assert "log_softmax" in rep["hint"]
    assert "out of scale" not in rep["hint"]


def test_critic_eps0_names_the_critics_update_not_the_weights_later_steps_broke(tmp_path):
    """Adam eps=0 on the critic, whose zero-initialised output gives its hidden layers
    gradients of exactly 0: its first update is 0/0 there. Recorded on the critic's Adam, the
    update's evidence is read as step 1 closes, and the bundle holds step 1's state, in which
    the actor's Adam and the slow critic's EMA wrote NaN from it too. The report named the
    actor's weights as made by the critic's update; now only the update's own, and the others
    in a note."""
    err = event_of(tmp_path, recorded="critic", critic_eps=0.0)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer")
    assert err.event["params"] == CRITIC_HIDDEN
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["cause"] == "optimizer"
    assert rep["origin"]["params"] == CRITIC_HIDDEN
    assert "critic.0.weight non-finite" in rep["hint"] and "eps=0" in rep["hint"]
    [note] = [p for p in rep["problems"] if "are not this update's" in p]
    assert note.startswith("10 more parameter(s) are non-finite in the bundle (actor.0.weight,")
    assert "the recorded optimizer does not hold" in note


@pytest.mark.parametrize("amp, step", [(False, 1), (True, 3)])
def test_critic_eps0_seen_from_the_world_model_names_both_writers(tmp_path, amp, step):
    """The same eps=0, recorded on the world model's Adam, whose forward never reads the
    critic: its weights are checked as each step closes now (the event came at step 2, when a
    gradient went NaN, with the actor's weights it had broken since), so the event is the step
    after the critic's first update (under AMP its scaler skipped steps 0 and 1, overflowed),
    on the critic and the EMA target the loop copied it into. The hint used to fall back to
    'checkpoint loading' for that mix of trained and frozen weights; it names each writer."""
    err = event_of(tmp_path, critic_eps=0.0, amp=amp)
    assert (err.event["step"], err.event["phase"]) == (step, "weights")
    assert err.event["params"] == CRITIC_HIDDEN + ["slow_" + n for n in CRITIC_HIDDEN]
    rep = nanreplay_json(err.bundle_path)
    assert rep["cause"] == "weights" and rep["reproduced"] is True
    hint = rep["hint"]
    assert hint.startswith("critic.0.weight, critic.0.bias (+2 more) train")
    assert f"non-finite when step {step} began: another optimizer's step() wrote them" in hint
    assert "eps=0" in hint
    assert "And slow_critic.0.weight, slow_critic.0.bias (+2 more) require no gradient" in hint
    assert "checkpoint loading" not in hint


def test_symexp_overflow_of_a_diverged_critic_blames_the_recorded_optimizers_gradients(
        tmp_path):
    """A symlog-MSE critic that diverged to ~90 decodes its values with an unclamped symexp:
    exp(90) overflows, the returns are inf and the return range inf - inf, so both the actor's
    and the critic's gradients are NaN in the step. Recorded on the critic's Adam, the event
    listed the actor's first (model order), whose update the recorded one is not; the
    critic's come first now. The world model's and actor's updates ran before the critic's
    step closed it: the replay says it cannot re-run the step, and why."""
    err = event_of(tmp_path, steps=1, recorded="critic", make="make_agent_diverged_critic",
                   behavior=W.mse_behavior_losses)
    ev = err.event
    assert (ev["step"], ev["phase"]) == (0, "backward")
    critic = [n for n in W.make_agent().state_dict() if n.startswith("critic.")]
    assert ev["params"] == critic + ACTOR
    assert ev["detail"].endswith("first critic.0.weight")
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["reproduced"] is False and rep["cause"] is None
    assert rep["origin"]["params"][:len(critic)] == critic
    assert any("changed during the step before its step() ran" in p for p in rep["problems"])
