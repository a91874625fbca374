"""End to end: imitation learning as imitation / stable-baselines3 / robomimic write it
(``imitation_learning_models``): behaviour cloning of a tanh-squashed Gaussian policy over
demos padded to a max length with a mask (a DataLoader, Adam, a step LR schedule,
clip_grad_norm_), robomimic's GMM policy, and GAIL's discriminator trained with BCE on expert
against policy pairs."""

from __future__ import annotations

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
             clip: float | None = None, epochs: int = 1):
    """BC over ``demo_set``; ``plant(obs, act, mask)`` edits the dataset before training."""
    obs, act, mask = demo_set()
    if plant is not None:
        plant(obs, act, mask)
    policy = getattr(M, make)()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    loader = DataLoader(TensorDataset(obs, act, mask), batch_size=B, shuffle=False)
    rec = FlightRecorder(policy, opt, loss_fn=M.squashed_nll, out_dir=out_dir,
                         factory=f"imitation_learning_models:{make}") if record else None
    loss_fn = rec.attach().loss_fn if rec else M.squashed_nll
    try:
        for _ in range(epochs):
            for o, a, m in loader:
                loss = loss_fn(policy(o), a, m, clip=clip)
                opt.zero_grad()
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
