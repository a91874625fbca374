"""Fine-tuning loops with several parameter groups (a backbone at 1e-5, a head at 1e-3, a
no-decay group of biases and norms), layers frozen and unfrozen, groups added, checkpoints
loaded and learning rates set by hand mid-run, recorded and replayed as a user runs them."""

from __future__ import annotations

import io

import param_groups_models as PG
import pytest
import torch
from bundles import invoke_cli, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K = 6  # the step whose learning rate the hand-written schedule sets wrong


def _head_lr_run(out_dir=None, head_lr: float | None = None, steps: int = 30):
    """SGD over the three groups; at step K the schedule sets the head group's rate to
    ``head_lr`` (None: leaves it). Returns (losses, the event's error or None)."""
    model = PG.make()
    opt = torch.optim.SGD(PG.hf_groups(model), momentum=0.9)
    head = next(i for i, g in enumerate(opt.param_groups)
                if any(p is model.head.weight for p in g["params"]))
    crit, losses = nn.CrossEntropyLoss(), []
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="param_groups_models:make") if out_dir else _nothing():
            for step in range(steps):
                if step == K and head_lr is not None:
                    opt.param_groups[head]["lr"] = head_lr
                x, y = PG.batch(step)
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return losses, e, head
    return losses, None, head


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_head_lr_set_wrong_is_tried_for_that_group_alone(out_dir):
    """The head group's rate set to 1e6 at step K: auto proposed ``lr=1e-05``, the median of
    group 0's (the backbone's) rates, applied to every group, which cut the head's rate 100x
    below what it trained at; and ``lr=1e-3`` set the backbone's 100x higher without a word.
    Auto now restores the jumped group's own rate alone (``lr[G]=``), which re-runs exactly
    what the run trains without the plant, and ``lr=VALUE`` says it set every group."""
    err = _head_lr_run(out_dir, head_lr=1e6)[1]
    healthy, _, head = _head_lr_run(steps=err.event["step"] + 1)
    at = err.event["step"]
    rep = nanreplay_json(err.bundle_path, "--try", "auto", "--try", f"lr={PG.HEAD_LR}",
                         "--try", f"lr[{head}]={PG.HEAD_LR}")
    began = rep["window"]["precursors_began"]
    assert (began["step"], began["kind"], began["group"]) == (K, "lr_jump", head)
    tries = {t["try"]: t for t in rep["what_if"]}
    auto = f"lr[{head}]={PG.HEAD_LR:.3g}"
    assert auto in tries and f"lr={PG.BACKBONE_LR:.3g}" not in tries
    for label in (auto, f"lr[{head}]={PG.HEAD_LR}"):
        t = tries[label]
        assert t["finite"] is True and not t["inconclusive"] and "note" not in t
        assert t["loss"] == healthy[at]  # the other groups' rates as recorded
    every = tries[f"lr={PG.HEAD_LR}"]
    assert every["finite"] is True and every["loss"] != healthy[at]
    assert f"set all 3 parameter groups' learning rates, recorded at {PG.BACKBONE_LR:.3g}, " \
           f"{PG.BACKBONE_LR:.3g}, 1e+06" in every["note"]


@pytest.mark.parametrize(("arg", "says"), [
    ("lr[3]=1e-3", "the optimizer has 3 parameter groups (0-2)"),
    ("wd[1]=0", "only lr takes a parameter group index"),
])
def test_group_index_a_try_cannot_take_is_a_usage_error(out_dir, arg, says):
    err = _head_lr_run(out_dir, head_lr=1e6)[1]
    res = invoke_cli(err.bundle_path, "--try", arg)
    assert res.exit_code == 2 and says in res.output and len(res.output.splitlines()) == 1


def _surgery_run(out_dir, ckpt: io.BytesIO, nan_at: int | None = None) -> list[float]:
    """The head trains alone (backbone frozen, not in the optimizer); at step 2 the backbone
    is unfrozen in a group of its own; a checkpoint saved at step 3 is resumed at step 5
    (model and optimizer); at step 6 the first layer is frozen again, its gradient dropped;
    the rates are halved by hand at step 7; at step 9 an early-stopping restore of the best
    weights, or, with ``nan_at``, a checkpoint holding a NaN, loaded at that step."""
    model = PG.make()
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW([{"params": model.head.parameters(), "lr": PG.HEAD_LR}],
                            weight_decay=PG.WD)
    crit, losses, best = nn.CrossEntropyLoss(), [], None
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=2,
                        factory="param_groups_models:make") if out_dir else _nothing():
        for step in range(11):
            if step == 2:
                model.backbone.requires_grad_(True)
                opt.add_param_group({"params": list(model.backbone.parameters()),
                                     "lr": PG.BACKBONE_LR})
            if step == 3:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
                best = {k: v.clone() for k, v in model.state_dict().items()}
            if step == 5:
                ckpt.seek(0)
                state = torch.load(ckpt)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
            if step == 6:
                model.backbone[0].weight.requires_grad = False
                model.backbone[0].weight.grad = None
            if step == 7:
                for g in opt.param_groups:
                    g["lr"] *= 0.5
            if step == (9 if nan_at is None else nan_at):
                if nan_at is not None:
                    best["backbone.3.weight"][1, 2] = float("nan")
                model.load_state_dict(best)
            x, y = PG.batch(step)
            opt.zero_grad(set_to_none=step % 2 == 0)
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_unfreeze_resume_refreeze_and_restore_train_as_without_the_recorder(out_dir, caplog):
    """Across add_param_group, a model and optimizer resumed from torch.save, a layer frozen
    with its gradient set to None, rates set by hand, zero_grad(set_to_none=False) and a
    restore of the best (finite) weights: the losses are bit-identical, nothing is an event
    and nothing is warned."""
    plain = _surgery_run(None, io.BytesIO())
    caplog.set_level("WARNING")
    assert _surgery_run(out_dir, io.BytesIO()) == plain
    assert not (out_dir.exists() and list(out_dir.glob("*.nan")))
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text


def test_checkpoint_holding_a_nan_loaded_mid_run_is_a_weights_event(out_dir):
    """A restore that loads a NaN into backbone.3.weight at step 8: the weights event of that
    step, that parameter, and the replay's cause ``weights`` reading it in backbone.3."""
    with pytest.raises(NonFiniteError) as info:
        _surgery_run(out_dir, io.BytesIO(), nan_at=8)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (8, "weights", ["backbone.3.weight"])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "weights"
    o = rep["origin"]
    assert (o["param"], o["module"], o["op"]) == ("backbone.3.weight", "backbone.3", "aten.addmm")


def test_layer_frozen_with_zeroed_grads_is_still_stepped_in_the_window(out_dir):
    """The first layer frozen at step 3 (``requires_grad_(False)``) in a loop that zeroes with
    ``set_to_none=False``: its gradient stays a zero tensor, so AdamW still moves it (momentum,
    decay). The window's re-run dropped that gradient and left the layer still, so its losses
    departed from the run's after the freeze, without a word. Now the recorder logs which
    frozen parameters held a gradient and the re-run steps them on zeros, as training did."""
    model = PG.make()
    opt = torch.optim.AdamW(PG.hf_groups(model))
    crit, losses, blank = nn.CrossEntropyLoss(), [], 5
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                            factory="param_groups_models:make"):
            for step in range(8):
                if step == 3:
                    model.backbone[0].requires_grad_(False)
                x, y = PG.batch(step)
                if step == K:
                    x[blank] = float("nan")
                opt.zero_grad(set_to_none=False)
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (K, "input")
    rep = nanreplay_json(info.value.bundle_path)
    w = rep["window"]
    assert w["steps"][0] <= 3 < K == w["steps"][1] and w["reproduced"]
    assert [s["loss"] for s in w["per_step"][:-1]] == losses[w["steps"][0]:K]
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [blank])


def _cosine_run(out_dir=None, head_span: int = 0, steps: int = 12):
    """AdamW over the three groups, each decayed by a hand-written cosine; the head's from
    step K over ``head_span`` steps (0: its progress (s - K) / 0 is NaN at step K, then
    inf, clamped to the end)."""
    model = PG.make()
    opt = torch.optim.AdamW(PG.hf_groups(model))
    base = [g["lr"] for g in opt.param_groups]
    crit, losses = nn.CrossEntropyLoss(), []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=4,
                        factory="param_groups_models:make") if out_dir else _nothing():
        for step in range(steps):
            g = opt.param_groups[-1]  # the head's group
            if step >= K:
                t = torch.tensor(float(step - K)) / head_span
                g["lr"] = base[-1] * float(0.5 * (1 + torch.cos(torch.pi * t.clamp(max=1))))
            x, y = PG.batch(step)
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_nan_rate_of_one_group_tries_that_group_s_last_rate_alone(out_dir):
    """The head group's decay spans 0 steps: its rate is NaN at step K, the update makes the
    head NaN. Auto proposed lr=1e-05 for every group: the largest rate of the ring's last
    finite row, a row after the event (the head's rate 0 there). It now tries the head's own
    last finite rate for the head alone, which re-runs what the run trains without the
    plant."""
    with pytest.raises(NonFiniteError) as info:
        _cosine_run(out_dir)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (K, "optimizer",
                                                       ["head.weight", "head.bias"])
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    assert "its lr was nan in that update" in rep["hint"]
    (t,) = rep["what_if"]
    assert t["try"] == f"lr[2]={PG.HEAD_LR:.3g}" and t["finite"] is True
    healthy = _cosine_run(head_span=10 ** 9, steps=t["steps"][1] + 1)  # the head keeps 1e-3
    assert t["loss"] == healthy[t["steps"][1]]


def test_head_lr_jump_before_an_optimizer_event_names_that_group_in_the_hint(tmp_path):
    """Recorded with guard_optimizer (no window): the head group's rate set to 1e30 at step K
    blows the head up in a later update. The hint said only 'check the learning rate and
    schedule' and auto tried lr=0.1x (still 1e29) and clip; it now names the group, its jump
    and the rate to set back, and auto tries that group's rate alone."""
    model = PG.make()
    opt = torch.optim.SGD(PG.hf_groups(model), momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, guard_optimizer=True,
                            factory="param_groups_models:make"):
            for step in range(12):
                if step == K:
                    opt.param_groups[2]["lr"] = 1e30
                x, y = PG.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert ev["step"] > K and (ev["phase"], ev["params"]) == ("optimizer",
                                                            ["head.weight", "head.bias"])
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    assert rep["cause"] == "optimizer"
    assert f"parameter group 2's learning rate jumped to 1e+30 at step {K}, 1e+33x its " \
           f"median {PG.HEAD_LR:.3g} before" in rep["hint"]
    assert f"--try lr[2]={PG.HEAD_LR:.3g}" in rep["hint"]
    assert f"lr[2]={PG.HEAD_LR:.3g}" in [t["try"] for t in rep["what_if"]]
