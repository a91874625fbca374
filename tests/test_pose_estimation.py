"""Human pose estimation trained as the pose repositories write it (``pose_estimation_models.py``):
a SimpleBaseline network regressing Gaussian heatmaps under HRNet's ``JointsMSELoss`` weighted
by ``target_weight``, integral regression (heatmaps normalised into distributions, expected
coordinates), Wing and OKS losses, a DataLoader with workers whose ``collate_fn`` returns dicts,
the horizontal flip done on the batch's tensors in the loop. With a planted bug the recorder
fires at the planted step and ``nanreplay --json`` names the op, the people, the cause and the
fix; healthy runs raise nothing and train bit-identically."""

from __future__ import annotations

import json
import math

import pose_estimation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
MODELS = "pose_estimation_models.py"


def _loop(model, opt, crit, batches, *, head="heatmap", flip=False, sched=None, seen=None):
    """One epoch as the repos' ``train()``: the batch dict to the model, the loss of the
    heatmaps (or coordinates) against the targets, weighted by visibility, clipped, stepped;
    ``seen`` gets each batch and output, as the loop went."""
    loss_fn = crit
    seen = [] if seen is None else seen
    for i, batch in enumerate(batches):
        if flip and i % 2 == 1:
            batch = M.flip_batch(batch)
        opt.zero_grad()
        if head == "heatmap":
            out = model(batch["image"])
            loss = loss_fn(out, batch["target"], batch["target_weight"])
        elif head == "dict":  # (the model reads the image and the visibility itself)
            out = model(batch)
            loss = loss_fn(out, batch["joints"], batch["target_weight"])
        elif head == "visible":
            out = model(batch["image"], batch["target_weight"])
            loss = loss_fn(out, batch["joints"], batch["target_weight"])
        elif head == "oks":
            out = model(batch["image"])
            loss = loss_fn(out, batch["joints"], batch["target_weight"], batch["area"])
        else:
            out = model(batch["image"])
            loss = loss_fn(out, batch["joints"], batch["target_weight"])
        seen.append((batch, out.detach()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        if sched is not None:
            sched.step()
    return seen


def _train(out_dir, model, opt, crit, batches, factory, **kw):
    """The loop under the recorder until it raises; the error and the batches it ran."""
    seen: list = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory):
            _loop(model, opt, crit, batches, seen=seen, **kw)
    return info.value, seen


def _report(err):
    rep = nanreplay_json(err.bundle_path)
    return rep, rep["origin"]


@pytest.mark.parametrize("setup", ["heatmap", "awing", "wing", "oks"])
def test_healthy_pose_training_raises_nothing_and_trains_the_same_weights(tmp_path, setup):
    """Two epochs of each setup on people with invisible joints, through a DataLoader with two
    workers (heatmap) whose collate_fn returns dicts, every other batch flipped on its tensors
    in the loop, gradients clipped, a MultiStepLR: no event, no bundle, and the weights bit for
    bit those of the same loop without the recorder."""
    ds = M.KeypointDataset(16, invisible={1: [0], 6: [1, 2], 13: [3]})
    workers = 2 if setup == "heatmap" else 0
    factory, crit, head = {
        "heatmap": (M.make_pose_resnet, M.JointsMSELoss(), "heatmap"),
        "awing": (M.make_pose_resnet, M.AdaptiveWingLoss(), "heatmap"),
        "wing": (M.make_integral_softmax, M.WingLoss(), "coords"),
        "oks": (M.make_integral_softmax, M.OKSLoss(), "oks")}[setup]
    spec = f"pose_estimation_models:{factory.__name__}"

    def run(recorded: bool):
        torch.manual_seed(1)
        model = factory()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1)
        steps = []
        for _ in range(2):
            batches = M.loader(ds, workers=workers)
            if recorded:
                with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path / "b",
                                    factory=spec):
                    seen = _loop(model, opt, crit, batches, head=head, flip=True,
                                 sched=sched)
            else:
                seen = _loop(model, opt, crit, batches, head=head, flip=True, sched=sched)
            steps.append(len(seen))
        return model.state_dict(), steps

    plain, n_plain = run(False)
    recorded, n_rec = run(True)
    assert n_plain == n_rec == [4, 4]
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    assert plain.keys() == recorded.keys()
    for k in plain:
        assert torch.equal(plain[k], recorded[k]), k


@pytest.mark.parametrize("dict_batch", [False, True])
def test_invisible_joints_zeroed_in_forward_make_0_over_0_in_the_integral_head(
        out_dir, dict_batch):
    """Integral regression with the visibility passed into the forward: the head zeroes the
    heatmaps of joints annotated invisible before normalising them by their sum, so a person
    with an invisible joint divides 0 by 0. People 1 and 3 of the third batch have one. Also
    with the whole batch dict given to the model (mmpose's ``model(batch)``), read through a
    DataLoader with two workers."""
    ds = M.KeypointDataset(16, invisible={9: [2], 11: [0, 3]})
    model = M.make_batch_pose() if dict_batch else M.make_integral("sum")
    factory = "make_batch_pose" if dict_batch else "make_integral"
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    err, seen = _train(out_dir, model, opt, M.IntegralLoss(),
                       M.loader(ds, workers=2 if dict_batch else 0),
                       f"pose_estimation_models:{factory}",
                       head="dict" if dict_batch else "visible")
    ev = err.event
    head = "pose.integral" if dict_batch else "integral"
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", head), ev
    hidden = (seen[-1][0]["target_weight"][..., 0] == 0).any(1).nonzero()[:, 0].tolist()
    assert hidden == [1, 3]
    rep, o = _report(err)
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        (head, "aten.div", "nan", hidden, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "prob = flat / flat.sum(")
    assert "0 by 0" in rep["hint"] and "eps" in rep["hint"], rep["hint"]


def test_a_fully_masked_heatmap_softmax_names_the_people_with_invisible_joints(out_dir):
    """Soft-argmax whose forward masks the heatmap of each invisible joint with -inf before
    the softmax (the visibility passed into the forward): the whole row is masked, NaN. The
    -inf of masked_fill is intended; the softmax is blamed, on person 1 of the third batch."""
    ds = M.KeypointDataset(16, invisible={9: [2]})
    model = M.make_integral_masked()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    err, _ = _train(out_dir, model, opt, M.IntegralLoss(), list(M.loader(ds)),
                    "pose_estimation_models:make_integral_masked", head="visible")
    assert (err.event["step"], err.event["phase"]) == (2, "forward"), err.event
    rep, o = _report(err)
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("integral", "aten._softmax", "nan", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "prob = F.softmax(self.beta * flat")
    assert [(c["op"], c["intentional"]) for c in o["chain"]] == \
        [("aten.masked_fill", True), ("aten._softmax", False)], o["chain"]
    assert "fully masked row" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("use_target_weight", [True, False])
def test_an_invisible_joints_all_zero_target_heatmap_normalised_by_its_sum(
        out_dir, use_target_weight):
    """A KL loss between the predicted heatmap and the target one normalised into a
    distribution: the target of an invisible joint is all zeros (HRNet's ``generate_target``),
    0/0. Weighted by visibility, its weight 0 does not drop the NaN (NaN * 0): the hint said
    the person's record was degenerate, to drop or repair it, and that an eps would train
    toward a made-up target, though the joint is one the loss leaves out by design and its
    weight of 0 trains toward nothing. It names the product by the mask now, and says to make
    the division safe. Unweighted, nothing masks it and the record advice stands."""
    ds = M.KeypointDataset(16, invisible={6: [1]})
    model = M.make_pose_resnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    err, seen = _train(out_dir, model, opt, M.HeatmapKLLoss(use_target_weight),
                       list(M.loader(ds)), "pose_estimation_models:make_pose_resnet")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    target = seen[-1][0]["target"]
    blank = (target.flatten(2).sum(-1) == 0).any(1).nonzero()[:, 0].tolist()
    assert blank == [2]
    rep, o = _report(err)
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", blank, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "q = t / t.sum(dim=-1")
    hint = rep["hint"]
    assert hint.startswith("aten.div of 0 by 0 (0/0), which exact arithmetic makes too"), hint
    if use_target_weight:
        mul = source_line(MODELS, "return (kl * target_weight[..., 0]).sum()")
        assert f"then aten.mul ({mul}) multiplied that NaN by a mask's 0" in hint, hint
        assert "clamp_min(eps)" in hint and "not in a bad record" in hint, hint
        assert "drop or repair" not in hint and "made-up target" not in hint, hint
    else:
        assert "mask's 0" not in hint and "drop or repair such records" in hint, hint


def test_a_hand_written_softmax_with_a_sharp_beta_overflows(out_dir):
    """DSNT-style soft-argmax with a learnable inverse temperature, its softmax written out
    as ``exp(beta * h) / sum(exp(beta * h))``; beta 30 keeps it sharp. As the heatmaps grow
    exp overflows (inf / inf): the report names exp, the people whose beta * h passed
    log(float32 max), and overflow."""
    ds = M.KeypointDataset(32)
    model = M.make_integral("softmax", 30.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    err, seen = _train(out_dir, model, opt, M.IntegralLoss(), list(M.loader(ds)),
                       "pose_estimation_models:make_integral_softmax", head="coords")
    ev = err.event
    assert ev["phase"] == "forward" and ev["step"] == len(seen) - 1 > 0, ev
    with torch.no_grad():  # (the weights of the event's forward: the update never ran)
        h = model.integral.beta * model.net(seen[-1][0]["image"])
    over = (h.flatten(1).amax(1) > math.log(torch.finfo(torch.float32).max))
    rep, o = _report(err)
    assert (o["module"], o["op"], o["made"], rep["cause"]) == \
        ("integral", "aten.exp", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert o["samples"] == over.nonzero()[:, 0].tolist() != [], (o["samples"], over)
    assert o["source"] == source_line(MODELS, "e = torch.exp(self.beta * flat)")
    assert "subtract the row max" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("flip_test", [False, True])
def test_a_zero_area_person_in_the_oks_loss(out_dir, flip_test):
    """OKS loss with the annotation's area as the scale: a person of area 0 divides d^2 by
    0; exp(-inf) is 0 and the loss finite, but the backward multiplies that 0 by the
    infinite derivative: NaN. With flip-test averaging in the loop, ``(model(x) +
    flip_coords(model(x.flip(3)))) / 2``, loss_fn is given no model output but a value made
    from two: the replay re-ran the loss on it as data, found no NaN and said the loss 'holds
    terms computed outside it', with no op, source or cause. It backpropagates the loss to
    such an argument now and names the node, the person and the fix, as without the flip."""
    ds = M.KeypointDataset(16, area={10: 0.0})
    model = M.make_integral_softmax()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.OKSLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="pose_estimation_models:make_integral_softmax"):
            for b in M.loader(ds):
                opt.zero_grad()
                x = b["image"]
                out = ((model(x) + M.flip_coords(model(x.flip(3)))) / 2 if flip_test
                       else model(x))
                crit(out, b["joints"], b["target_weight"], b["area"]).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    rep, o = _report(info.value)
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "DivBackward0", "nan", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "e = d2 / var / area[:, None] / 2")
    assert "annotation's area" in rep["hint"] and "instance of area 0" in rep["hint"], \
        rep["hint"]
    assert rep["reproduced"] is True
    if flip_test:
        assert o["tensor"] == "loss_args[0]", o
        assert not any("computed outside" in p for p in rep["problems"]), rep["problems"]
        assert any("made from the model's outputs" in p and "is not re-run" in p
                   for p in rep["problems"]), rep["problems"]


def test_an_adaptive_wing_overflow_on_8_bit_target_heatmaps_blames_the_data(out_dir):
    """Adaptive Wing loss, as its authors write it, takes ``pow(theta / eps, alpha - y - 1)``
    of the target heatmap ``y``, meant in [0, 1]. The third batch's heatmaps come rendered as
    8-bit images (0..255): 0.5 ** -253 overflows float32. The hint said to subtract the row
    max before exp or bound a learned exponent; the op took the loss's data alone, and the
    hint says so now and names that argument's range. (The boolean masks the output chose,
    ``y[delta < theta]``, pick the target's values: they stay the data's.)"""
    ds = M.KeypointDataset(16)
    model = M.make_pose_resnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.AdaptiveWingLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="pose_estimation_models:make_pose_resnet"):
            for i, b in enumerate(M.loader(ds)):
                target = b["target"] * 255 if i == 2 else b["target"]
                opt.zero_grad()
                crit(model(b["image"]), target, b["target_weight"]).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep, o = _report(info.value)
    assert (o["module"], o["op"], o["made"], rep["cause"]) == \
        ("<loss>", "aten.pow", "+inf", "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "A = self.omega * (1 / (1 + torch.pow(")
    hint = rep["hint"]
    assert hint.startswith("aten.pow's true result"), hint
    assert f"loss's data alone (loss_args[1] up to {float(target.max()):.4g}" in hint, hint
    assert "[0, 255] where [0, 1] is meant" in hint and "row max" not in hint, hint
