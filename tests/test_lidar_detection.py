"""End to end on a PointPillars/CenterPoint LiDAR detector (``lidar_detection_models``): a
dense pillar voxelisation with padded pillars, the pillar feature net's point mean and scan
intensity normalisation, the BEV scatter, CenterPoint's heatmap focal loss and log-encoded
box regression, trained with AdamW, OpenPCDet's one-cycle schedule and gradient clipping.
Each planted bug of the domain fires under the recorder and is replayed with the CLI; the
healthy version raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import lidar_detection_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("lidar_detection_models.py", text)


def train(make: str, out_dir, bad: int | None = None, plant: str = "", steps: int = 4,
          record: bool = True, per_scene: str = "", every_step: bool = False,
          amp: bool = False, accum: int = 1):
    """OpenPCDet's recipe: AdamW, a one-cycle schedule, clip_grad_norm_(10) (of the unscaled
    gradients under float16 autocast with a GradScaler, ``amp``); the planted scene ``bad``
    is in the last step's batch (in every step's with ``every_step``); ``accum``: the batch
    split into as many micro-batches, their gradients accumulated."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    crit = M.CenterPointLoss(per_scene=per_scene)
    g = torch.Generator().manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler if amp else None,
                         factory=f"lidar_detection_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            planted = every_step or step == steps - 1
            points, num, coords, hm, boxes, ind, reg_mask = M.batch(
                g, bad=bad if planted else None, plant=plant)
            opt.zero_grad()
            for mb in zip(*(t.chunk(accum) for t in (points, num, coords, hm, boxes, ind,
                                                     reg_mask))):
                with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                    hm_pred, reg = model(*mb[:3])
                loss = loss_fn(hm_pred.float(), reg.float(), *mb[3:]) / accum
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= scale:  # (not after a step the scaler skipped)
                sched.step()
    return model


def fire(make: str, tmp_path, bad: int, plant: str, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, bad, plant, **kw)
    return info.value.event, info.value.bundle_path


def test_padded_pillar_point_mean_names_the_division_and_the_sparse_scene(tmp_path):
    """A rain-blinded sweep fills 6 of the 24 pillar slots; the padded pillars have 0 points,
    and the PFN's cluster mean ``sum / num_points`` is 0/0 there. Multiplying by the point
    mask keeps the NaN (NaN * 0), BatchNorm's batch statistics spread it to every scene. The
    replay names the division, its line, the sparse scene only, and says 0/0."""
    ev, bundle = fire("make_centerpoint_unmasked_mean", tmp_path, bad=2, plant="sparse")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "pfn", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "pfn", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("mean = points[..., :3].sum(dim=2, keepdim=True) / count"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_scan_without_intensity_names_the_normalisation_by_its_max_of_zero(tmp_path):
    """A sweep from a sensor that reports no intensity (every return 0): the PFN divides the
    intensity channel by the scan's maximum, 0/0 in every point of that scene. The replay
    names that division, its line, the dark scene, and says 0/0 with an eps for advice."""
    ev, bundle = fire("make_centerpoint_scan_max", tmp_path, bad=1, plant="dark")
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "forward", "pfn", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("pfn", "aten.div", "nan", [1]), o
    assert o["source"] == line_of("intensity = points[..., 3:] / scan_max"), o
    assert rep["cause"] == "invalid" and "eps" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_label_of_width_zero_names_the_log_size_encoding_and_the_scene(tmp_path):
    """An annotator's degenerate box (w = 0) in scene 3: the regression target
    ``log(w / anchor_w)`` is -inf and the L1 loss +inf. A loss event; the replay names the log
    in the loss on the box's scene and points at the data (a degenerate label to drop or
    repair in the dataset), not at an eps."""
    ev, bundle = fire("make_centerpoint", tmp_path, bad=3, plant="flat")
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf", [3]), o
    assert o["source"] == line_of("target = torch.cat([boxes[:, :3], torch.log("), o
    assert rep["cause"] == "invalid" and "box of zero width" in rep["hint"], rep["hint"]
    assert "drop or repair such records" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("per_scene,line", [
    ("dims", "hm_loss = (cells.sum((1, 2, 3)) / pos.sum((1, 2, 3))).mean()"),
    ("flat", "hm_loss = (cells.flatten(1).sum(1) / pos.flatten(1).sum(1)).mean()")])
def test_scene_without_objects_names_the_per_scene_focal_normaliser(tmp_path, per_scene, line):
    """A parking lot at night with no labelled object: the focal loss normalised per scene by
    its own number of objects divides that scene's (positive) negative-cell loss by 0, +inf.
    The replay names the division in the loss and the empty scene; the scene is valid (its
    negatives should train), so the hint says to floor the count (CenterPoint's
    max(num_pos, 1)), not to drop or filter the record as it does for a degenerate one, nor
    (of the flattened heatmap's 2-D count) that a graph's row has no neighbour."""
    ev, bundle = fire("make_centerpoint", tmp_path, bad=0, plant="empty", per_scene=per_scene)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "+inf", [0]), o
    assert o["source"] == line_of(line), o
    assert rep["cause"] == "invalid" and "count per sample of a 0/1 mask" in rep["hint"], rep
    assert "do not drop them" in rep["hint"] and "max(num_pos, 1)" in rep["hint"], rep["hint"]
    assert "filter such records" not in rep["hint"] and "neighbour" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("plant", ["sparse", "dark", "empty"])
def test_guarded_runs_raise_nothing_and_train_the_same(tmp_path, plant):
    """The fixed code (the mean over max(num_points, 1), the scan max floored, the focal loss
    over max(num_pos, 1)) on batches that hold the planted scene at every step: padded pillars
    that the scatter drops, a dark scan, a scene without objects. No event, bit-identical
    weights with and without the recorder."""
    recorded = train("make_centerpoint", tmp_path, bad=1, plant=plant, steps=3, every_step=True)
    plain = train("make_centerpoint", tmp_path, bad=1, plant=plant, steps=3, every_step=True,
                  record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_far_ghost_points_overflow_the_float16_squared_distance_matmul(tmp_path):
    """A pillar of ghost returns 300 m out (no point cloud range filter) in scene 2, under
    float16 autocast: PointNet++'s ``square_distance`` computes ``-2 s·d`` by a matmul that
    autocast runs in float16, and 300² is past its 65504. The replay names the matmul in the
    context module, the far scene, overflow, that the distances were made of the data alone
    (a range filter to add, or float32), not that the run was diverging after the one-cycle
    warmup's learning-rate jump (it said so)."""
    ev, bundle = fire("make_centerpoint_context", tmp_path, bad=2, plant="far", amp=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "context"), ev
    rep = nanreplay_json(bundle, "--try", "drop=2")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["dtype"]) == (
        "context", "aten.bmm", "+inf", [2], "float16"), o
    assert o["source"] == line_of("dist = -2 * torch.matmul(src, dst.transpose(1, 2))"), o
    assert rep["cause"] == "overflow" and "float32" in rep["hint"], rep["hint"]
    assert "range filter" in rep["hint"] and "made of the batch's data alone" in rep["hint"]
    # (the one-cycle warmup's learning-rate jump at step 2 is no divergence: nothing learned
    # reaches the distances)
    assert any(p["kind"] == "lr_jump" for p in rep["precursors"]), rep["precursors"]
    assert "the run was diverging" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_context_model_under_float16_autocast_raises_nothing_and_trains_the_same(tmp_path):
    """The point-context model under float16 autocast and a GradScaler on in-range sweeps:
    no event, bit-identical weights with and without the recorder."""
    recorded = train("make_centerpoint_context", tmp_path, steps=3, amp=True)
    plain = train("make_centerpoint_context", tmp_path, steps=3, amp=True, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_masked_max_over_padded_pillars_is_no_false_alarm(tmp_path):
    """The PFN's max over each pillar's points with the padding filled with -inf (as
    masked max-pooling is written): a padded pillar's feature is -inf in every channel, the
    PFN's output holds it, and the scatter drops those pillars before anything else reads
    them. No event, bit-identical weights with and without the recorder."""
    kw = dict(bad=1, plant="sparse", steps=3, every_step=True)
    recorded = train("make_centerpoint_masked_max", tmp_path, **kw)
    plain = train("make_centerpoint_masked_max", tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    points, num, coords, *_ = M.batch(torch.Generator().manual_seed(0), bad=1, plant="sparse")
    with torch.no_grad():  # (the -inf pillars are there: 18 padded slots of the sparse scene)
        assert int(torch.isneginf(recorded.eval().pfn(points, num, coords)[1]).all(1).sum()) == 18


def test_sparse_scene_in_the_second_accumulated_micro_batch_is_named_there(tmp_path):
    """The padded-pillar 0/0 with the batch split into two accumulated micro-batches of two
    scenes: the sparse scene 3 is row 1 of micro-batch 1, where the event and the replay
    name it."""
    ev, bundle = fire("make_centerpoint_unmasked_mean", tmp_path, bad=3, plant="sparse",
                      accum=2)
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == (3, "forward", "pfn", 1), ev
    rep = nanreplay_json(bundle, "--try", "drop=1")
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"]) == ("pfn", "aten.div", 1, [1]), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
