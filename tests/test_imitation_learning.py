"""End to end: imitation learning as imitation / stable-baselines3 / robomimic write it
(``imitation_learning_models``): behaviour cloning of a tanh-squashed Gaussian policy over
demos padded to a max length with a mask (a DataLoader, Adam, a step LR schedule,
clip_grad_norm_), robomimic's GMM policy, and GAIL's discriminator trained with BCE on expert
against policy pairs."""

from __future__ import annotations

import json

import imitation_learning_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "imitation_learning_models.py"
B, T = 8, 5  # demos a batch, max demo length


def demo_set(n_batches: int = 5):
    """Demos of 2..T steps padded to T: padded steps repeat the last frame (robomimic's
    ``pad_frame_seq``), expert actions normalised into (-1, 1)."""
    g = torch.Generator().manual_seed(0)
    n = B * n_batches
    obs = torch.randn(n, T, M.OBS, generator=g)
    act = torch.tanh(obs[..., :M.ACT] + 0.1 * torch.randn(n, T, M.ACT, generator=g))
    lens = torch.randint(2, T + 1, (n,), generator=g)
    mask = torch.arange(T) < lens[:, None]
    last = act[torch.arange(n), lens - 1]
    act = torch.where(mask[..., None], act, last[:, None])
    return obs, act, mask


def train_bc(out_dir, make: str = "make_policy", record: bool = True, plant=None,
             clip: float | None = None, epochs: int = 1, resume: dict | None = None,
             accum: int = 1, bf16: bool = False):
    """BC over ``demo_set``; ``plant(obs, act, mask)`` edits the dataset before training;
    ``resume``: the policy's checkpoint to go on from; ``accum`` micro-batches a step, the
    forward under bf16 autocast with ``bf16``."""
    obs, act, mask = demo_set()
    if plant is not None:
        plant(obs, act, mask)
    policy = getattr(M, make)()
    if resume is not None:
        policy.load_state_dict(resume)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    loader = DataLoader(TensorDataset(obs, act, mask), batch_size=B, shuffle=False)
    rec = FlightRecorder(policy, opt, loss_fn=M.squashed_nll, out_dir=out_dir,
                         factory=f"imitation_learning_models:{make}") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.squashed_nll
    try:
        for _ in range(epochs):
            for o, a, m in loader:
                opt.zero_grad()
                for oc, ac, mc in zip(o.chunk(accum), a.chunk(accum), m.chunk(accum)):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        out = policy(oc)
                    loss = loss_fn(tuple(t.float() for t in out), ac, mc, clip=clip) / accum
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
                sched.step()
    finally:
        if rec:
            rec.detach()
    return policy


def raised(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values()))


def gripper_closed(obs, act, mask):
    """Demo 3 of batch 2 (row 19) closes the gripper at its step 1: exactly +1, as robomimic's
    gripper actions are (the normaliser left that dim alone)."""
    act[2 * B + 3, 1, 0] = 1.0


def test_expert_action_at_the_bound_names_atanh_and_its_demo(tmp_path):
    """``atanh(1) = inf`` inverting the squash of an expert action at the bound: the loss is
    +inf at step 2 (the batch holding that demo), made by atanh in the loss, in row 3."""
    err = raised(train_bc, tmp_path, plant=gripper_closed)
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"]) == (
        True, "invalid", "aten.atanh", "<loss>", [3]), rep
    assert o["source"] == source_line(MODELS, "u = torch.atanh(actions)")
    assert "clamp its input inside (-1, 1)" in rep["hint"], rep["hint"]
    assert "clamp the actions first, as SB3's TanhBijector.inverse does" in rep["hint"]


def test_bf16_micro_batches_name_the_micro_batch_and_its_row(tmp_path):
    """Under bf16 autocast, two micro-batches of 4 a step, demo 6 of batch 2 opens the gripper
    at exactly -1: row 2 of micro-batch 1. The report names atanh there, and says which row of
    the loop's batch that is (the loop chunked it)."""
    def opened(obs, act, mask):
        act[2 * B + 6, 0, 1] = -1.0

    err = raised(train_bc, tmp_path, plant=opened, accum=2, bf16=True)
    assert (err.event["step"], err.event["phase"], err.event["micro_batch"]) == (2, "loss", 1)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["made"], o["micro_batch"], o["samples"]) == (
        "invalid", "aten.atanh", "-inf", 1, [2]), rep
    assert "samples [2] are rows [6] there" in json.dumps(rep), rep


def padded_gripper(obs, act, mask):
    """Demo 6 of batch 1 (row 14, 3 steps of 5) ends with the gripper at exactly -1: its padded steps repeat
    that raw action, while the normaliser clipped the valid ones into the open interval."""
    act[..., 1] = act[..., 1].clamp(-1 + 1e-6, 1 - 1e-6)
    n = int(mask[B + 6].sum())
    assert n < T  # (a demo with padding)
    act[B + 6, n:, 1] = -1.0


def test_padded_step_at_the_bound_names_atanh_and_the_mask_that_did_not_drop_it(tmp_path):
    """Only the padded steps hold -1: ``atanh`` makes -inf there and the masked sum's
    ``nll * m`` makes it NaN (inf * 0). The report blames atanh, row 6, and says the mask
    applied after the op does not keep the padded value out."""
    err = raised(train_bc, tmp_path, plant=padded_gripper)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (1, "loss", "nan")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "aten.atanh", "<loss>", [6]), rep
    assert "multiplied that infinity by a mask's 0" in rep["hint"], rep["hint"]
    last = o["chain"][-1]
    assert (last["op"], last["made"], last["source"]) == (
        "aten.mul", "nan", source_line(MODELS, "nll * m")), o["chain"]


def test_clipped_inverse_trains_past_the_bound_and_the_same_as_unrecorded(tmp_path):
    """SB3's ``TanhBijector.inverse`` clamps to ``1 - eps`` first: the same data trains with
    no event, and the recorder changes nothing that training computes."""
    plant = lambda o, a, m: (gripper_closed(o, a, m), padded_gripper(o, a, m))  # noqa: E731
    got = train_bc(tmp_path, plant=plant, clip=1e-6, epochs=2)
    want = train_bc(tmp_path, plant=plant, clip=1e-6, epochs=2, record=False)
    assert same_weights(got, want)
    assert not list(tmp_path.glob("*.nan"))


def pairs(g: torch.Generator, n: int = 16):
    """Expert state-action pairs (the expert acts ``tanh`` of its first state dims) and the
    learner's rollout pairs (uniform actions)."""
    eo = torch.randn(n, M.OBS, generator=g)
    po = torch.randn(n, M.OBS, generator=g)
    pa = torch.rand(n, M.ACT, generator=g) * 2 - 1
    return eo, torch.tanh(eo[:, :M.ACT]), po, pa


def train_gail(out_dir, naive: bool, record: bool = True, raw_row: int | None = 4,
               steps: int = 5, gp: float = 0.0):
    """GAIL's discriminator updates; at step 2 expert state ``raw_row`` holds an unnormalised
    feature (a raw timestep, 1000) that drives ``D`` to a logit past 17, where float32's
    sigmoid is exactly 1. ``gp``: the weight of a gradient penalty on pairs mixed between
    expert and learner (WGAN-GP's, as AIRL implementations add: ``create_graph=True``)."""
    disc = M.make_discriminator()
    opt = torch.optim.Adam(disc.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(disc, opt, loss_fn=M.gail_bce, out_dir=out_dir,
                         factory="imitation_learning_models:make_discriminator") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.gail_bce
    y = torch.cat([torch.ones(16), torch.zeros(16)])
    try:
        for step in range(steps):
            eo, ea, po, pa = pairs(g)
            if step == 2 and raw_row is not None:
                eo[raw_row, 4] = 1000.0
            loss = loss_fn(disc(torch.cat([eo, po]), torch.cat([ea, pa])), y, naive=naive)
            if gp:
                loss = loss + gp * gradient_penalty(disc, eo, ea, po, pa, g)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if rec:
            rec.detach()
    return disc


def gradient_penalty(disc, eo, ea, po, pa, g):
    eps = torch.rand(len(eo), 1, generator=g)
    obs = (eps * eo + (1 - eps) * po).requires_grad_(True)
    act = (eps * ea + (1 - eps) * pa).requires_grad_(True)
    grads = torch.autograd.grad(disc(obs, act).sum(), [obs, act], create_graph=True)
    norm = torch.cat(grads, -1).norm(2, dim=-1)
    return ((norm - 1) ** 2).mean()


def test_gail_bce_written_with_sigmoid_names_log_of_1_minus_d_and_the_expert_row(tmp_path):
    """``-(y log D + (1 - y) log(1 - D))`` with D = sigmoid rounded to 1: log(0) = -inf in the
    expert row 4, times its label's 0 = NaN. The report names the log, row 4, precision (1 - y
    of a sigmoid), and sends the user to logsigmoid / BCE with logits."""
    err = raised(train_gail, tmp_path, naive=True)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (2, "loss", "nan")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"], o["made"]) == (
        "precision", "aten.log", "<loss>", [4], "-inf"), rep
    assert o["source"] == source_line(MODELS, "torch.log(1 - d)).mean()  # the bug")
    assert "logsigmoid(−z)" in rep["hint"], rep["hint"]
    assert o["chain"][-1]["op"] == "aten.mul", o["chain"]


def test_gail_bce_with_logits_trains_through_the_saturated_row_as_unrecorded(tmp_path):
    """``binary_cross_entropy_with_logits`` on the same pairs: no event, same weights."""
    got = train_gail(tmp_path, naive=False)
    assert same_weights(got, train_gail(tmp_path, naive=False, record=False))
    assert not list(tmp_path.glob("*.nan"))


def test_gail_with_gradient_penalty_raises_nothing_and_trains_as_unrecorded(tmp_path):
    """The penalty's double backward through the discriminator, without the raw feature:
    no false alarm, and the same weights as without the recorder."""
    got = train_gail(tmp_path, naive=False, raw_row=None, gp=10.0)
    want = train_gail(tmp_path, naive=False, raw_row=None, gp=10.0, record=False)
    assert same_weights(got, want)
    assert not list(tmp_path.glob("*.nan"))


def train_gmm(out_dir, make: str, record: bool = True, steps: int = 4):
    """robomimic's GMM BC; at step 2 state 6 is a depth reading in millimetres (5000 times
    the others' scale), which drives one mode's softplus scale to a subnormal 2e-43."""
    policy = getattr(M, make)()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(policy, opt, loss_fn=M.gmm_nll, out_dir=out_dir,
                         factory=f"imitation_learning_models:{make}") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.gmm_nll
    try:
        for step in range(steps):
            obs, act, _, _ = pairs(g)
            if step == 2:
                obs[6] *= 5000.0
            loss = loss_fn(policy(obs), act)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    finally:
        if rec:
            rec.detach()
    return policy


def test_gmm_with_min_std_0_names_the_division_by_the_underflowed_softplus_and_its_floor(
        tmp_path):
    """With ``min_std`` 0, row 6's scale ``softplus(s) + 0`` underflows to 0 (1.9e-71 in
    float64) and ``(a - mean) / scale`` is +inf. The report names the division, row 6,
    underflow, and sends the user to the floor added after softplus (not to a log-space form
    the scale does not need), and to the out-of-scale state that drove it there."""
    err = raised(train_gmm, tmp_path, "make_gmm_no_floor")
    assert (err.event["step"], err.event["phase"]) == (2, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"], o["made"]) == (
        "underflow", "aten.div", "<loss>", [6], "+inf"), rep
    assert o["source"] == source_line(MODELS, "z = (a - means) / scales")
    hint = rep["hint"]
    assert "softplus's result plus a number (a floor: softplus(s) + min_std)" in hint, hint
    assert "not of an exponential" not in hint, hint
    assert "sample(s) 6 of batch" in hint and "--try drop=6" in hint, hint


def test_gmm_with_min_std_trains_through_the_same_state_as_unrecorded(tmp_path):
    """robomimic's ``min_std`` floor keeps the scale off 0: no event, same weights."""
    got = train_gmm(tmp_path, "make_gmm")
    assert same_weights(got, train_gmm(tmp_path, "make_gmm", record=False))
    assert not list(tmp_path.glob("*.nan"))


def collapsed_checkpoint(make: str) -> dict:
    """A BC checkpoint whose ``log_std`` of action dim 1 drifted to -60: a long run on an
    expert whose second action never varies (its NLL keeps rewarding a narrower Gaussian)."""
    state = getattr(M, make)().state_dict()
    state["log_std"][1] = -60.0
    return state


def test_unclamped_log_std_that_drifted_names_the_division_and_the_parameter(tmp_path):
    """SB3's state-independent ``log_std`` without the clamp: ``exp(-60) ** 2`` is 0 in
    float32, ``(x - mu) ** 2 / (2 * std ** 2)`` is -inf for every demo. The report names the
    division, every row, underflow, and the parameter with its value and the clamp to add."""
    err = raised(train_bc, tmp_path, "make_policy_unclamped", clip=1e-6,
                 resume=collapsed_checkpoint("make_policy_unclamped"))
    assert (err.event["step"], err.event["phase"]) == (0, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["all_samples"]) == (
        "underflow", "aten.div", "<loss>", True), rep
    assert o["source"] == source_line(MODELS, "/ (2 * std ** 2)")
    assert "the exp of the parameter log_std (as low as -60)" in rep["hint"], rep["hint"]
    assert "log_std.clamp(min=-20)" in rep["hint"], rep["hint"]


def test_clamped_log_std_trains_from_the_same_checkpoint_as_unrecorded(tmp_path):
    """The clamp to [-20, 2] keeps ``std ** 2`` at 4e-18: no event, same weights."""
    ckpt = collapsed_checkpoint("make_policy")
    got = train_bc(tmp_path, clip=1e-6, resume=ckpt)
    assert same_weights(got, train_bc(tmp_path, clip=1e-6, resume=ckpt, record=False))
    assert not list(tmp_path.glob("*.nan"))


def left_padded(obs, act, mask):
    """The demos moved to the end of their window (a sequence dataset that pads in front):
    a padded step's query then sees only padded keys, causal and padding masks together."""
    for b in range(len(mask)):
        k = T - int(mask[b].sum())
        obs[b], act[b], mask[b] = obs[b].roll(k, 0), act[b].roll(k, 0), mask[b].roll(k, 0)


def train_transformer(out_dir, left: bool, record: bool = True, steps: int = 4):
    """BC-Transformer with AdamW and a warmup, one batch of demos a step."""
    obs, act, mask = demo_set()
    if left:
        left_padded(obs, act, mask)
    policy = M.make_transformer()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    rec = FlightRecorder(policy, opt, loss_fn=M.squashed_nll, out_dir=out_dir,
                         factory="imitation_learning_models:make_transformer") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.squashed_nll
    try:
        for step in range(steps):
            s = slice(step * B, (step + 1) * B)
            loss = loss_fn(policy(obs[s], ~mask[s]), act[s], mask[s], clip=1e-6)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
    finally:
        if rec:
            rec.detach()
    return policy


@pytest.mark.parametrize("left", [False, True])
def test_transformer_over_padded_demos_raises_nothing_and_trains_as_unrecorded(tmp_path, left):
    """The causal and key-padding masks' -inf stay inside attention (a left-padded step's
    query sees no valid key; PyTorch's attention keeps that row finite): no false alarm, and
    the recorder changes nothing training computes."""
    got = train_transformer(tmp_path, left)
    assert same_weights(got, train_transformer(tmp_path, left, record=False))
    assert not list(tmp_path.glob("*.nan"))


def train_airl_policy(out_dir, naive: bool, steps: int = 4):
    """The learner's policy-gradient steps on AIRL's rewards ``log D - log(1 - D)`` from a
    fixed discriminator (computed under no_grad, outside the recorded model); at step 2 state
    5 holds a raw timestep (1000) that drives D's logit past float32's sigmoid range."""
    policy, disc = M.make_policy(), M.make_discriminator()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(policy, opt, loss_fn=M.pg_loss, out_dir=out_dir,
                         factory="imitation_learning_models:make_policy")
    loss_fn = rec.attach().loss_fn
    try:
        for step in range(steps):
            obs = torch.randn(16, M.OBS, generator=g)
            if step == 2:
                obs[5, 4] = 1000.0
            with torch.no_grad():
                mu, log_std = policy(obs)
                act = torch.tanh(mu + log_std.exp() * torch.randn(mu.shape, generator=g))
                rewards = M.airl_reward(disc(obs, act), naive=naive)
            loss = loss_fn(policy(obs), act, rewards)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        rec.detach()
    return policy


def test_airl_reward_written_with_sigmoid_names_the_rewards_argument_and_its_row(tmp_path):
    """``-log(1 - D)`` of D rounded to 1 is a +inf reward in row 5; the loss's advantage
    normalisation makes NaN of it (inf - inf). The report names the rewards argument, row 5,
    cause input, and says to make the reward finite where the loop computed it, from the
    logit, not to clamp a "log-probability" (no KLDivLoss here: no log_target)."""
    err = raised(train_airl_policy, tmp_path, naive=True)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        2, "input", "loss_args[2]", [5]), ev
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [5]), rep
    hint = rep["hint"]
    assert hint.startswith("loss_args[2] (rewards) holds +inf and no NaN"), hint
    assert "a finite ceiling (1e4)" in hint and "log_target" not in hint, hint
    assert "the logit itself for log D - log(1 - D)" in hint, hint


def test_airl_reward_as_the_logit_trains_through_the_same_state(tmp_path):
    """The reward as D's logit (``log D - log(1 - D)`` exactly): no event."""
    train_airl_policy(tmp_path, naive=False)
    assert not list(tmp_path.glob("*.nan"))


def train_diffusion(out_dir, zero_snr: bool, record: bool = True, steps: int = 6):
    """Diffusion Policy's training step: a timestep per sample, the expert action noised to
    it, the noise predicted; AdamW, an EMA-free loop."""
    net = M.make_noise_predictor()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=1e-6)
    ab = M.alphas_cumprod(zero_snr)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(net, opt, loss_fn=M.min_snr_loss, out_dir=out_dir,
                         factory="imitation_learning_models:make_noise_predictor") if record \
        else None
    loss_fn = rec.attach().loss_fn if rec else M.min_snr_loss
    seen = []
    try:
        for _ in range(steps):
            obs, act, _, _ = pairs(g, 8)
            t = torch.randint(0, M.STEPS, (8,), generator=g)
            seen.append(t)
            noise = torch.randn(act.shape, generator=g)
            a = ab[t][:, None]
            noisy = a.sqrt() * act + (1 - a).sqrt() * noise
            loss = loss_fn(net(obs, noisy, t), noise, t, ab)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    finally:
        if rec:
            rec.detach()
    return net, seen


def test_min_snr_weight_at_zero_terminal_snr_names_the_division_and_the_last_timestep_rows(
        tmp_path):
    """Rescaled to zero terminal SNR, the schedule's last ``alpha_bar`` is 0, so the min-SNR
    weight ``min(snr, 5) / snr`` is 0/0 for every sample drawn at t = T - 1 (step 0 draws
    one). The report names the division in the loss and exactly those rows."""
    with pytest.raises(NonFiniteError) as info:
        train_diffusion(tmp_path, zero_snr=True)
    err = info.value
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (0, "loss", "nan")
    g = torch.Generator().manual_seed(0)
    pairs(g, 8)
    last = torch.randint(0, M.STEPS, (8,), generator=g).eq(M.STEPS - 1).nonzero().flatten()
    assert last.tolist(), "step 0 drew no last timestep"
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], o["samples"]) == (
        "invalid", "aten.div", "<loss>", last.tolist()), rep
    assert o["source"] == source_line(MODELS, "w = snr.clamp(max=gamma) / snr")


def test_diffusion_policy_without_zero_terminal_snr_trains_as_unrecorded(tmp_path):
    """The capped cosine schedule keeps every ``alpha_bar`` > 0: no event, same weights."""
    got, _ = train_diffusion(tmp_path, zero_snr=False)
    want, _ = train_diffusion(tmp_path, zero_snr=False, record=False)
    assert same_weights(got, want)
    assert not list(tmp_path.glob("*.nan"))
