"""End to end: Diffusion Policy (Chi et al.) as its code base trains it
(``diffusion_policy_models``): episodes cut into observation histories and action chunks by a
``Dataset`` read through ``DataLoader`` workers, actions min-max normalised to [-1, 1] inside
the policy, a depth ResNet and a FiLM-conditioned 1-D temporal U-Net predicting the noise of a
squared-cosine DDPM schedule, AdamW, gradient clipping, a hand-written EMA."""

from __future__ import annotations

import diffusion_policy_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "diffusion_policy_models.py"
B = 8


def loader(eps, workers: int = 0) -> DataLoader:
    return DataLoader(M.EpisodeDataset(eps), batch_size=B, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0), num_workers=workers)


def train(out_dir, make: str = "make_policy", plant=None, record: bool = True,
          fp16: bool = False, half: bool = False, loss=None, epochs: int = 1, workers: int = 0,
          fit: bool = False, val: int = 0):
    """``train_diffusion_unet_image_workspace``'s loop: ``plant(episodes)`` edits the data;
    ``fp16``: the forward under float16 autocast; ``half``: the policy and its batches in
    float16 (``make`` builds it so); ``fit``: the normaliser refitted on every episode (the
    replay buffer's, as ``get_normalizer`` does) after the factory built the policy; ``val``:
    the last episodes held out of training (the validation mask); ``loss`` an ``EpsilonLoss`` (with a gripper term: its
    target, closed at every step, is passed beside the outputs)."""
    eps = M.episodes()
    if plant is not None:
        plant(eps)
    policy = getattr(M, make)()
    if fit:
        policy.normalizer.fit(eps)
        policy.obs_normalizer.fit(eps)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4, betas=(0.95, 0.999),
                            weight_decay=1e-6)
    ema = M.EMA(policy)
    loss = loss or M.EpsilonLoss()
    rec = FlightRecorder(policy, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"diffusion_policy_models:{make}") if record else None
    loss_fn = rec.attach().loss_fn if rec else loss
    try:
        for _ in range(epochs):
            for proprio, depth, act in loader(eps[:len(eps) - val], workers):
                if half:
                    proprio, depth, act = proprio.half(), depth.half(), act.half()
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    out = policy(proprio, depth, act)
                closed = torch.ones(act.shape[0], M.HORIZON, dtype=torch.bool)
                value = loss_fn(out, closed) if len(out) > 2 else loss_fn(out)
                value.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
                ema.update(policy)
    finally:
        if rec:
            rec.detach()
    return policy, ema


def raised(fn, *args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kw)
    return info.value


def first_batch(eps, bad) -> tuple[int, list[int]]:
    """The first step whose batch ``bad(proprio, depth)`` marks rows of, and those rows."""
    for step, (proprio, depth, _) in enumerate(loader(eps)):
        rows = bad(proprio, depth).nonzero().flatten().tolist()
        if rows:
            return step, rows
    raise AssertionError("no batch holds the planted record")


def origin(rep) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"]


def dropped_joint(eps):
    """Episode 3's joint encoder dropped one reading: NaN in the proprioception at step 5."""
    eps[3]["proprio"][5, 1] = float("nan")


def test_a_dropped_joint_reading_is_named_as_input_with_the_windows_holding_it(tmp_path):
    """Two observation windows hold the NaN reading (they start at steps 4 and 5); the
    shuffled loader puts them in one batch: an input event there, naming those rows."""
    eps = M.episodes()
    dropped_joint(eps)
    step, rows = first_batch(eps, lambda p, d: p.isnan().flatten(1).any(1))
    err = raised(train, tmp_path, plant=dropped_joint)
    assert (err.event["step"], err.event["phase"]) == (step, "input"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["samples"]) == (True, "input", rows)
    assert len(rows) == 2, rows


def test_a_nan_reading_in_the_batch_dictionary_names_its_key_and_rows(tmp_path):
    """``compute_loss(batch)`` over the collated ``{"obs": {"agent_pos", "depth"}, "action"}``
    of the code base's datasets: the input event names the nested key and the same rows."""
    eps = M.episodes()
    dropped_joint(eps)
    step, rows = first_batch(eps, lambda p, d: p.isnan().flatten(1).any(1))
    policy = M.make_batch_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4, weight_decay=1e-6)
    data = DataLoader(M.DictEpisodeDataset(eps), batch_size=B, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            policy, opt, loss_fn=M.EpsilonLoss(), out_dir=tmp_path,
            factory="diffusion_policy_models:make_batch_policy") as rec:
        for batch in data:
            opt.zero_grad()
            rec.loss_fn(policy(batch)).backward()
            opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (step, "input"), err.event
    assert err.event["tensor"] == 'batch["obs"]["agent_pos"]', err.event
    rep = nanreplay_json(err.bundle_path)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", rows), rep


def test_a_locked_gripper_names_the_normalisers_range_of_0_not_a_batch_statistic(tmp_path):
    """The gripper never moves in the demos, so the fitted max equals the min and the
    normaliser without Chi's ``range_eps`` divides 0 by 0 in that dimension of every sample.
    The hint named a divisor 'that is a statistic over the batch' and advised statistics over
    the whole dataset (they are); it must name the two buffers, the entry, and the guard."""
    err = raised(train, tmp_path, make="make_policy_no_range_eps")
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (0, "forward", "nan")
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "invalid", "aten.div", "normalizer", list(range(B))), rep
    assert rep["origin"]["source"] == source_line(MODELS, "return (x - self.lo) / rng * 2 - 1")
    hint = rep["hint"]
    assert hint.startswith("aten.div of 0 by 0 (0/0): the divisor is normalizer.hi - "
                           "normalizer.lo, a range the model keeps in two buffers"), hint
    assert f"0 at entry {M.GRIP}, where the two are equal" in hint, hint
    assert "range_eps" in hint and "statistic over the batch" not in hint, hint
    assert "whole dataset" not in hint, hint


def jittering_gripper(eps):
    """The gripper is not quite locked: its width jitters by up to 5 micrometres."""
    g = torch.Generator().manual_seed(1)
    for ep in eps:
        ep["action"][:, M.GRIP] += (torch.rand(len(ep["action"]), generator=g) - 0.5) * 1e-5


def test_a_range_float16_rounds_to_0_is_said_to_be_the_buffers_type(tmp_path):
    """The jitter's range, 1e-5, is below float16's spacing at 0.04: fitted into the buffers
    of a ``.half()`` policy, max == min, and the normaliser divides 0 by 0 (in float32 it
    trains). The hint said only 'a dimension that never moves'; it must say the type."""
    train(tmp_path, make="make_policy_no_range_eps", plant=jittering_gripper, fit=True)
    assert not list(tmp_path.glob("*.nan"))
    err = raised(train, tmp_path, make="make_policy_half_no_range_eps", plant=jittering_gripper,
                 fit=True, half=True)
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "invalid", "aten.div", "normalizer", list(range(B))), rep
    assert "But the buffers are float16, whose spacing at 0.04 is 3.05e-05" in rep["hint"]


def locked_joint(eps):
    """Joint 3 never moves in the demos: the dataset's std of it is 0."""
    for ep in eps:
        ep["proprio"][:, 3] = 0.7


def test_a_locked_joint_in_a_float16_policy_names_the_std_buffer_and_the_lost_eps(tmp_path):
    """``(x - self.mean) / (self.std + 1e-8)`` trains in float32 (the eps keeps 0/0 away), but
    1e-8 is 0 in float16: 0/0 for that joint in every observation. The hint said 'a divisor
    that is a statistic over the batch'; it must name the std buffer, then the lost eps."""
    train(tmp_path, plant=locked_joint, fit=True)
    assert not list(tmp_path.glob("*.nan"))
    err = raised(train, tmp_path, make="make_policy_half", plant=locked_joint, fit=True,
                 half=True)
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "underflow", "aten.div", "obs_normalizer", list(range(B))), rep
    assert rep["origin"]["source"] == source_line(MODELS, "return (x - self.mean) / (self.std")
    hint = rep["hint"]
    assert "at column(s) [3] of every one of the 16 rows: the divisor was made of the model's " \
           "buffer obs_normalizer.std alone" in hint, hint
    assert "statistic over the batch" not in hint, hint
    assert "the eps 1e-08 added to that input is 0 in float16" in hint, hint


def millimetre_depth(eps):
    """The depth frames as the camera gives them, uint16 millimetres; one pixel of episode 2's
    frame 7 holds the driver's no-reading value 65535."""
    for ep in eps:
        ep["depth"].mul_(1000)
    eps[2]["depth"][7, 0, 3, 3] = 65535.0


def test_a_no_reading_depth_pixel_under_float16_autocast_is_named_overflow_at_the_stem(
        tmp_path):
    """65535 is above float16's largest 65504: autocast's cast for the stem convolution makes
    +inf, in the windows holding that frame; the hint names the uint16 value."""
    eps = M.episodes()
    millimetre_depth(eps)
    step, rows = first_batch(eps, lambda p, d: d.flatten(1).amax(1) > 65504)
    err = raised(train, tmp_path, plant=millimetre_depth, fp16=True)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (step, "forward", "+inf")
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "overflow", "aten._to_copy", "encoder.stem", rows), rep
    assert "65535 = 2**16 - 1" in rep["hint"], rep["hint"]


def test_a_float16_policy_under_adamw_names_the_optimizer_and_its_eps(tmp_path):
    """``policy.half()`` with AdamW's eps=1e-8, which is 0 in float16: a gradient that rounds
    to 0 makes 0/0 in the update, at step 0; the report blames the optimizer and its eps."""
    err = raised(train, tmp_path, make="make_policy_half", half=True)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer"), err.event
    rep = nanreplay_json(err.bundle_path, code=None)
    assert rep["cause"] == "optimizer", rep
    assert "eps=1e-08 is 0 in float16" in rep["hint"], rep["hint"]


def test_a_gripper_bce_written_with_where_names_the_log_backward_of_the_saturated_rows(
        tmp_path):
    """The gripper head's bias starts at 18: ``sigmoid`` rounds to 1 in float32, and the
    ``where`` keeps ``log(p)`` but the backward of the unselected ``log(1 - p)`` is 0 * inf:
    NaN gradients only, at step 0, in every row (every logit is above 17)."""
    err = raised(train, tmp_path, make="make_policy_gripper_head", loss=M.EpsilonLoss(0.1))
    assert (err.event["step"], err.event["phase"]) == (0, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "precision", "LogBackward0", "<loss>", list(range(B))), rep
    assert rep["origin"]["source"] == source_line(MODELS, "ll = torch.where(closed,")
    assert "binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]


def test_a_gripper_bce_under_float16_autocast_names_the_log_of_the_underflowed_sigmoid(
        tmp_path):
    """An 'open' prior of -18 on the gripper logits, which come out of float16 autocast:
    ``sigmoid(-18)`` = 1.5e-8 is below float16's smallest subnormal and rounds to 0, so the
    selected ``log(p)`` of the closed steps is -inf and the loss +inf at step 0."""
    err = raised(train, tmp_path, make="make_policy_gripper_open", loss=M.EpsilonLoss(0.1),
                 fp16=True)
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (0, "loss", "+inf")
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "underflow", "aten.log", "<loss>", list(range(B))), rep
    assert rep["origin"]["source"] == source_line(MODELS, "ll = torch.where(closed,")
    assert "below float16's smallest normal number" in rep["hint"], rep["hint"]


def validation_dropout(eps):
    """The held-out episode (the last) lost one action reading: NaN at its step 10."""
    eps[-1]["action"][10, 0] = float("nan")


def test_a_normaliser_fitted_over_a_validation_episode_with_a_nan_names_its_buffers(tmp_path):
    """``get_normalizer`` reads the whole replay buffer, validation episodes too: the NaN
    reading makes the fitted min and max NaN in dimension 0, while no training batch holds it.
    The first step's ``x - self.lo`` is NaN in every row; the report names the buffers the
    loop wrote after the factory built them, not the batch."""
    err = raised(train, tmp_path, plant=validation_dropout, fit=True, val=1)
    assert (err.event["step"], err.event["phase"]) == (0, "forward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "weights", "aten.sub", "normalizer", list(range(B))), rep
    assert "buffer normalizer.lo, normalizer.hi finite" in rep["hint"], rep["hint"]


def last_step_rows(make: str) -> list[int]:
    """The rows whose diffusion step, drawn in step 0's forward as the policy draws it (after
    the noise, from the generator the factory seeded), is the schedule's last."""
    policy = getattr(M, make)()
    torch.randn(B, M.HORIZON, M.ACT)
    t = torch.randint(0, policy.steps, (B,))
    return (t == policy.steps - 1).nonzero().flatten().tolist()


def test_an_x0_loss_over_an_uncapped_schedule_names_its_last_step_and_the_drawing_rows(
        tmp_path):
    """Without ``max_beta`` the squared-cosine schedule's last beta is 1 and alphas_cumprod
    ends at exactly 0: the x0 the prediction implies divides by sqrt(0) for the samples that
    drew that step. The hint said the divisor was 'computed from the data: a time or time step,
    a length, a count' and 'a diffusion time t = 0 where the noise schedule's std vanishes';
    it must name the buffer as a schedule 0 at its last entry, and the cap."""
    rows = last_step_rows("make_policy_x0_unclipped")
    err = raised(train, tmp_path, make="make_policy_x0_unclipped",
                 loss=M.EpsilonLoss(x0_weight=0.5))
    assert (err.event["step"], err.event["phase"], err.event["kind"]) == (0, "forward", "+inf")
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "invalid", "aten.div", "", rows), rep
    assert rep["origin"]["source"] == source_line(MODELS, "x0_hat = (noisy - (1 - ab).sqrt()")
    hint = rep["hint"]
    assert hint.startswith("aten.div by 0 (x/0, a pole): its input was looked up in the buffer "
                           "alphas_cumprod, a schedule over 10 steps"), hint
    assert "exactly 0 at its last entry (9)" in hint and "max_beta=0.999" in hint, hint


def test_the_clipped_x0_over_an_uncapped_schedule_is_a_backward_nan_at_the_division(tmp_path):
    """The same x0 clipped to [-1, 1] (``clip_sample``): the forward is finite, the clamp's
    backward sends 0 into the division's, whose derivative at sqrt(0) makes 0/0: a backward
    event at step 0, ``DivBackward0`` on the rows that drew the last step, and the hint names
    the schedule as the forward's would."""
    rows = last_step_rows("make_policy_x0_uncapped")
    err = raised(train, tmp_path, make="make_policy_x0_uncapped",
                 loss=M.EpsilonLoss(x0_weight=0.5))
    assert (err.event["step"], err.event["phase"]) == (0, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert origin(rep) == (True, "invalid", "DivBackward0", "", rows), rep
    assert rep["origin"]["source"] == source_line(MODELS, "x0_hat = (noisy - (1 - ab).sqrt()")
    hint = rep["hint"]  # (was: the divisor 'computed from the batch's data: an annotation's
    # area, a count, a target', 'drop or repair them where the data is made')
    assert hint.startswith("DivBackward0 made a non-finite gradient from finite incoming "
                           "gradients: the forward's aten.div by 0 (x/0, a pole): its input "
                           "was looked up in the buffer alphas_cumprod"), hint
    assert "exactly 0 at its last entry (9)" in hint and "not in the backward" in hint, hint


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_healthy_policy_raises_nothing_and_trains_as_unrecorded(tmp_path):
    """Two epochs through two DataLoader workers, with the normaliser's guard: no bundle, and
    the weights and the EMA's are bit-identical with and without the recorder."""
    got, got_ema = train(tmp_path, epochs=2, workers=2)
    want, want_ema = train(tmp_path, epochs=2, workers=2, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert same(got.state_dict(), want.state_dict())
    assert same(got_ema.shadow, want_ema.shadow)


def train_amp(out_dir, record: bool = True):
    """float16 autocast with a GradScaler whose first scale (2**30) overflows the gradients
    (skipped steps until it backs off), grads unscaled before clipping, and
    ``AveragedModel``'s EMA made after the recorder attached."""
    eps = M.episodes()
    policy = M.make_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4, weight_decay=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    loss = M.EpsilonLoss()
    rec = FlightRecorder(policy, opt, loss_fn=loss, out_dir=out_dir, scaler=scaler,
                         factory="diffusion_policy_models:make_policy") if record else None
    loss_fn = rec.attach().loss_fn if rec else loss
    ema = AveragedModel(policy, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    try:
        for _ in range(2):
            for proprio, depth, act in loader(eps):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = policy(proprio, depth, act)
                scaler.scale(loss_fn(out)).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                ema.update_parameters(policy)
    finally:
        if rec:
            rec.detach()
    return policy, ema, scaler.get_scale()


def test_float16_autocast_with_a_grad_scaler_skipping_steps_trains_as_unrecorded(tmp_path):
    """The scaler's skipped steps are no event; weights, EMA and scale are bit-identical."""
    got, got_ema, got_scale = train_amp(tmp_path)
    want, want_ema, want_scale = train_amp(tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    assert got_scale == want_scale < 2.0 ** 30
    assert same(got.state_dict(), want.state_dict())
    assert same(got_ema.state_dict(), want_ema.state_dict())
