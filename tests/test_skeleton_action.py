"""End to end on skeleton-based action recognition and motion prediction
(``skeleton_action_models``): ST-GCN over ``(N, C, T, V, M)`` clips with persons folded into the
batch, 2s-AGCN's learned adjacency offset under the confidence mask, bone and joint-angle
streams, per-person normalisation, ST-GCN's random rotation from a ``torch.Generator``, label
smoothing, SGD with Nesterov momentum and a linear warmup, gradient clipping; a GRU motion
predictor with a relative velocity loss. Each planted failure of the domain fires under the
recorder and is replayed with the CLI; the healthy runs raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import skeleton_action_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("skeleton_action_models.py", text)


PLANTS = {
    "missing": lambda x, conf, rows: [M.missing_joints(x, conf, r) for r in rows],
    "lost_frame": lambda x, conf, rows: [M.lost_frame(x, conf, r, 3) for r in rows],
    "single": lambda x, conf, rows: [M.single_person(x, conf, r) for r in rows],
    "straight": lambda x, conf, rows: [M.straight_arm(x, r) for r in rows],
    "empty": lambda x, conf, rows: [M.empty_clip(x, conf, r) for r in rows],
}


def train(make: str, out_dir, plant: str | None = None, rows=(), steps: int = 4,
          record: bool = True, rotate: bool = True, accumulate: int = 1, amp: bool = False):
    """ST-GCN's recipe: SGD with Nesterov momentum and weight decay, a linear warmup, label
    smoothing, clipping; the rows ``rows`` of the last step's batch get ``plant``; ``amp``:
    the forward under CPU autocast to bfloat16."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"skeleton_action_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            opt.zero_grad()
            for k in range(accumulate):
                x, conf, y = M.skeleton_batch(g)
                # (the dataset's record, then augmented; in the step's last micro-batch)
                if plant and step == steps - 1 and k == accumulate - 1:
                    PLANTS[plant](x, conf, rows)
                if rotate:
                    x = M.random_rotation(x, g)
                with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                    out = model(x, conf)
                loss = loss_fn(out.float(), y) / accumulate
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 4.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, plant: str, rows, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant, rows, **kw)
    return info.value.event, info.value.bundle_path


@pytest.mark.parametrize("accumulate,amp", [(1, False), (2, True)])
def test_joints_missing_in_every_frame_isolate_them_in_the_masked_graph(tmp_path, accumulate,
                                                                        amp):
    """The estimator lost both hands of clip 2 (confidence 0, coordinates zero-filled): the
    confidence mask cuts every edge of those joints, self-loops included, so their degree is
    0 and ``deg.pow(-0.5)`` is +inf, NaN once multiplied by the cut edges' 0. The block's rows
    are clips times persons (ST-GCN folds ``M`` into the batch before the blocks): the replay
    names the pow in the first block's graph conv, on clip 2 only, with the degree advice (a
    fill after the pow would leave the learned degree's gradient NaN, as the test below
    shows: the hint says to give the pow a safe base); dropping the clip makes the step
    finite. So too in the second of two micro-batches under
    bfloat16 autocast."""
    ev, bundle = fire("make_stgcn", tmp_path, "missing", [2], accumulate=accumulate, amp=amp)
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == (
        3, "forward", "blocks.0.gcn", 0), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        True, "blocks.0.gcn", 0, "aten.pow", "+inf", [2]), o
    assert o["micro_batch"] == accumulate - 1, o
    assert o["source"] == line_of("d = deg.pow(-0.5)"), o
    assert rep["cause"] == "invalid" and "deg == 0" in rep["hint"], rep["hint"]
    assert "torch.where(deg > 0, deg, 1)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_lost_frame_zero_length_bones_name_the_bone_normalisation(tmp_path):
    """The estimator lost the person in frame 3 of clip 4: every joint there zero-filled, so
    every bone has length 0 and the bone stream's ``bones / length`` is 0/0. The replay names
    the division in the stream, clip 4 (the batch-norm after it spreads the NaN to every clip's
    output, which is what the recorder's event rows show), and the eps advice."""
    ev, bundle = fire("make_bone", tmp_path, "lost_frame", [4])
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "stream", "nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("stream", "aten.div", "nan", [4])
    assert o["source"] == line_of("unit = bones / length"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_straight_arm_rounds_the_cosine_past_one_under_rotation(tmp_path):
    """Clip 3 holds its left arm straight out (neck, shoulder, hand collinear): after the
    random rotation the two bones' unit vectors differ by rounding, their dot product is
    1.0000001 and the unclamped ``acos`` is NaN. The replay names the acos, clip 3, a precision
    cause (float64 gives 1) and the clamp advice."""
    ev, bundle = fire("make_angle", tmp_path, "straight", [3])
    assert (ev["step"], ev["module"]) == (3, "stream"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("stream", "aten.acos", "nan", [3])
    assert o["source"] == line_of("angle = torch.acos(cos)"), o
    assert rep["cause"] == "precision" and "clamp" in rep["hint"], rep["hint"]


def test_padded_second_person_divided_by_its_own_size(tmp_path):
    """Clips 2 and 5 have one person; the second is padded with zeros, whose size (largest
    distance from the hip) is 0, so the per-person normalisation is 0/0. The replay names the
    division and exactly those clips; dropping them makes the step finite."""
    ev, bundle = fire("make_person_norm", tmp_path, "single", [2, 5])
    assert (ev["step"], ev["module"]) == (3, "stream"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2,5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "stream", "aten.div", "nan", [2, 5]), o
    assert o["source"] == line_of("return centred / scale"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("plant,rows,amp", [("missing", [2], False), ("single", [2, 5], True)])
def test_guarded_graph_with_masked_attention_raises_nothing_and_trains_the_same(
        tmp_path, plant, rows, amp):
    """The isolated joints' degrees guarded (``d[deg == 0] = 0``) and attention pooling that
    fills the missing joints' logits with -inf (the padded person's whole row left unmasked):
    the same planted clips, two micro-batches per step (under bfloat16 autocast too), raise
    no event, and the weights are bit-identical with and without the recorder."""
    recorded = train("make_stgcn_guarded", tmp_path, plant, rows, accumulate=2, amp=amp)
    plain = train("make_stgcn_guarded", tmp_path, plant, rows, accumulate=2, amp=amp,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    assert all(torch.isfinite(p).all() for p in plain.parameters())


def test_inverse_degree_filled_after_the_pow_still_makes_a_nan_gradient(tmp_path):
    """PyG's guard, the isolated joint's ``deg ** -0.5`` filled with 0 after the pow, keeps the
    forward finite; but the degree is learned (2s-AGCN's offset ``B``), and PowBackward0 at
    degree 0 multiplies the fill's zero gradient by an infinite derivative. A backward event;
    the replay names the pow's backward node on the pow's line, in the last block's graph conv
    (the first the backward reaches), clip 2 (the node's gradient is over clips times
    persons, folded before the blocks), and says to make the input safe before the op rather
    than masking after."""
    ev, bundle = fire("make_stgcn_filled", tmp_path, "missing", [2], accumulate=2)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["micro_batch"], o["samples"]) == (
        "backward", "blocks.1.gcn", "PowBackward0", "nan", 1, [2]), o
    assert o["source"] == line_of("d = deg.pow(-0.5)"), o
    assert rep["cause"] == "invalid", rep
    assert "masked_fill" in rep["hint"] and "safe before the op" in rep["hint"], rep["hint"]


def train_motion(out_dir, frozen: int | None = None, eps: float = 0.0, steps: int = 4,
                 record: bool = True, make: str = "make_motion", loss=None, at: int = -1):
    """Martinez et al.'s recipe: Adam, a step decay, clipping at 5; batches from a
    DataLoader over the clips; ``frozen``: a clip of batch ``at`` whose capture froze."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    crit = loss or M.RelativeVelocityLoss(eps)
    g = torch.Generator().manual_seed(0)
    clips = [M.motion_batch(g, frozen=frozen if k == at % steps else None)
             for k in range(steps)]
    data = torch.utils.data.TensorDataset(torch.cat([c[0] for c in clips]),
                                          torch.cat([c[1] for c in clips]))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"skeleton_action_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for past, future in loader:
            pred = model(past, future.shape[1])
            loss = loss_fn(pred, future, past[:, -1])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def test_frozen_capture_divides_the_velocity_error_by_a_speed_of_zero(tmp_path):
    """Clip 5 of the last batch froze in capture (one pose repeated): every joint's true
    speed is 0 and the relative velocity error is x/0 = +inf, with the loss's eps at 0. A loss
    event; the replay names the division in the loss, clip 5, and says the eps of 0 guarded
    nothing; dropping the clip makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_motion(tmp_path, frozen=5)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.div", "+inf", [5]), o
    assert o["source"] == line_of("rel = (vp - vt).norm(dim=-1) / (vt.norm(dim=-1) + self.eps)")
    assert rep["cause"] == "invalid" and "exactly 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_motion_predictor_with_an_eps_raises_nothing_and_trains_the_same(tmp_path):
    """The same frozen clip with ``eps=1e-3``: no event, bit-identical weights with and without
    the recorder."""
    recorded = train_motion(tmp_path, frozen=5, eps=1e-3)
    plain = train_motion(tmp_path, frozen=5, eps=1e-3, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_zero_velocity_start_on_a_frozen_clip_makes_the_distance_gradient_infinite(tmp_path):
    """The residual head zero-initialised predicts the last pose repeated; a frozen clip's
    future is exactly that pose, so the hand-written distance ``sqrt(sum(d ** 2))`` is
    sqrt(0), whose derivative is infinite: a backward event at step 0. The replay names
    SqrtBackward0 in the loss on its line, the clip, and vector_norm's gradient of 0 there;
    dropping the clip makes the step finite."""
    with pytest.raises(NonFiniteError) as info:
        train_motion(tmp_path, frozen=6, make="make_motion_zero_velocity", loss=M.mpjpe_loss,
                     at=0)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=6")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", "+inf", [6]), o
    assert o["source"] == line_of("pos = ((pred - future) ** 2).sum(-1).sqrt().mean()"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def train_split(out_dir, absent: int | None = None, single: int | None = None):
    """Four batches of a split through the NTU-style Dataset and a DataLoader, the loss
    weighted by the split's balanced class weights; ``absent``: an action no clip of the split
    has (relabelled); ``single``: a clip with one person."""
    g = torch.Generator().manual_seed(0)
    xs, confs, ys = zip(*[M.skeleton_batch(g) for _ in range(4)])
    x, conf, y = torch.cat(xs), torch.cat(confs), torch.cat(ys)
    if absent is not None:
        y[y == absent] = (absent + 1) % 5
    if single is not None:
        M.single_person(x, conf, single)
    crit = torch.nn.CrossEntropyLoss(weight=M.balanced_class_weights(y, 5), label_smoothing=0.1)
    model = M.make_stgcn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    loader = torch.utils.data.DataLoader(M.SkeletonClips(x, conf, y), batch_size=10)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="skeleton_action_models:make_stgcn") as rec:
            for xb, cb, yb in loader:
                opt.zero_grad()
                rec.loss_fn(model(xb, cb), yb).backward()
                opt.step()
    return info.value.event, info.value.bundle_path


def test_action_absent_from_the_split_gives_its_class_weight_inf(tmp_path):
    """sklearn's balanced weights n / (classes * count) of a split without action 4: its
    weight is inf, which label smoothing takes into every clip's loss (the smoothed target
    puts mass on every class). A loss event at step 0; the replay says it is the loss's
    'weight' holding inf at index 4, made before the step, and to clamp the count."""
    ev, bundle = train_split(tmp_path, absent=4)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["module"]) == ("loss", "<loss>"), rep
    assert rep["cause"] == "weights", rep
    assert "'weight' holding inf at index 4" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" in rep["hint"], rep["hint"]


def test_padded_person_normalised_in_the_dataset_is_bad_input(tmp_path):
    """The Dataset divides each person by their torso length; clip 33 has one person, the
    padded one's torso is 0, and the clip reaches the model holding NaN (batch 3, row 3): an
    input event on that row, the data pipeline named as the place to look."""
    ev, bundle = train_split(tmp_path, single=33)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        3, "input", "args[0]", [3]), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [3]), rep
    assert "division by zero in normalisation" in rep["hint"], rep["hint"]


def test_clip_with_nobody_in_it_divides_by_no_person_present(tmp_path):
    """The graph guarded, persons averaged over those present: clip 7, where the estimator
    found nobody, has none, and the root's own ``sum / present.sum()`` is 0/0. The replay
    names the division in the root module on clip 7; dropping it makes the step finite."""
    ev, bundle = fire("make_stgcn_person_mean", tmp_path, "empty", [7])
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "", [7]), ev
    rep = nanreplay_json(bundle, "--try", "drop=7")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [7]), o
    assert o["source"] == line_of("x = (x * present[..., None]).sum(1) / present.sum(1"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_rotation_layer_with_its_own_generator_is_replayed_with_its_draw(tmp_path):
    """The rotation as a layer drawing from a generator it keeps (seeded once, drawn at every
    step): whether clip 3's straight arm rounds its cosine past 1 depends on that step's
    angle, so the replay reproduces only with the layer's generator set back to the state it
    had at step 3. It does, and names the acos on clip 3."""
    ev, bundle = fire("make_angle_augmented", tmp_path, "straight", [3], rotate=False)
    assert (ev["step"], ev["module"]) == (3, "stream.1"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "stream.1", "aten.acos", [3], "precision"), rep


def test_more_scales_than_the_skeleton_is_wide_builds_a_nan_graph(tmp_path):
    """MS-G3D's disentangled k-hop graphs, 6 scales on a skeleton at most 4 hops across:
    from k = 3 some joints (k = 5: all) have no joint k hops away, degree 0, and the graphs
    normalised once in ``__init__`` hold NaN. The event is the first multi-scale conv's
    forward at step 0; the replay says the factory builds the buffer non-finite (not the
    data, not an update), names the scales 3, 4 and 5, and the einsum that took it."""
    ev, bundle = fire("make_msg3d", tmp_path, None, [])
    assert (ev["step"], ev["module"]) == (0, "blocks.0.gcn"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"]) == ("weights", "blocks.0.gcn", "aten.bmm"), rep
    assert o["source"] == line_of('return torch.einsum("nkctv,kvw->nctw", y, self.A)'), o
    assert "the factory builds buffer blocks.0.gcn.A, blocks.1.gcn.A non-finite" in rep["hint"]
    assert "row(s) 3, 4, 5 of 6 of blocks.0.gcn.A" in rep["hint"], rep["hint"]
