"""End to end: monocular depth estimation trained as BTS / AdaBins / MiDaS write it
(``depth_estimation_models``): a U-Net over images with sparse LiDAR ground truth (0 where no
point hit) from a DataLoader, the camera's focal length an extra ``forward`` argument, AdamW
with OneCycleLR, clip_grad_norm_, gradient accumulation and bfloat16 autocast; SILog, berHu
and MiDaS's scale-and-shift-invariant losses. Planted data conditions and bugs make the
NaN; the replay must name the op, the step, the image and the fix."""

from __future__ import annotations

import json

import depth_estimation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "depth_estimation_models.py"
BS = 4


def train(out_dir, factory, crit, data, *, record=True, accum=1, bf16=False):
    """The loop: batches of ``BS`` from a DataLoader, ``model(img, focal)`` for the metric
    head, the loss in float32 over the autocast output; returns the model."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    loader = DataLoader(TensorDataset(*data), batch_size=BS, shuffle=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=len(loader))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"depth_estimation_models:{factory}") if record else None
    loss_fn = rec.attach().loss_fn if rec else crit
    try:
        for i, (img, depth, focal) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pred = model(img, focal) if factory == "make_depthnet" else model(img)
            pred = tuple(t.float() for t in pred) if isinstance(pred, tuple) else pred.float()
            (loss_fn(pred, depth) / accum).backward()
            if (i + 1) % accum == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
    finally:
        if rec:
            rec.detach()
    return model


def raised(*args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kw)
    return info.value


def test_midas_alignment_of_a_frame_without_lidar_points_is_0_by_0_in_its_image(out_dir):
    """MiDaS's scale-and-shift-invariant loss solves each image's 2x2 least squares in closed
    form; written without MiDaS's ``det != 0`` guard, a frame with no LiDAR point (image 6:
    step 1, row 2) has ``det = 0`` and its scale is 0/0. The report names that division and
    that image; with the guard the same data trains. The NaN then met the mask's 0, and the
    hint said it lay in entries the loss leaves out by design, "nothing is to drop"; the mask
    is 0 in every pixel of that image, a frame with no ground truth, which the hint says now."""
    img, depth, focal = M.scenes(16)
    depth[6] = 0
    train(out_dir / "guarded", "make_midas", M.ScaleAndShiftInvariantLoss(guard=True),
          (img, depth, focal))
    assert not list((out_dir / "guarded").glob("*.nan"))
    err = raised(out_dir, "make_midas", M.ScaleAndShiftInvariantLoss(guard=False),
                 (img, depth, focal))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "x_0 = (a_11 * b_0 - a_01 * b_1) / det"), o
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]
    # (not "entries the loss was meant to leave out, nothing to drop": the frame has no point)
    assert "the mask is 0 in every entry of those samples" in rep["hint"], rep["hint"]
    assert "nothing is to drop" not in rep["hint"] and "--try drop=2" in rep["hint"]


def test_berhu_threshold_of_an_image_without_ground_truth_is_a_pole_under_where(out_dir):
    """berHu with its threshold per image, ``c = 0.2 max|d|``: an image with no valid pixel
    (image 9: step 2, row 1) has ``c = 0`` and ``(d^2 + c^2) / 2c`` is 0/0 there, which
    ``torch.where(d <= c, d, l2)`` drops in the forward: the loss is finite and the backward
    of the division makes the NaN gradient. The report names that node, its line and image,
    and says that where still sends the gradient through both branches."""
    img, depth, focal = M.scenes(16)
    depth[9] = 0
    err = raised(out_dir, "make_depthnet", M.BerHuLoss(), (img, depth, focal))
    ev = err.event
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "DivBackward0", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "l2 = (diff ** 2 + c ** 2) / (2 * c)"), o
    assert "sends the gradient through both branches" in rep["hint"], rep["hint"]
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_silog_log_of_the_lidar_holes_dropped_by_the_mask_trains_as_without_recorder(out_dir):
    """AdaBins' SILog takes ``log(gt)`` of the whole sparse map (-inf at every hole) and picks
    the valid pixels after: the -inf never reaches the loss. Under bfloat16 autocast with
    accumulation over 2 batches, the recorder raises nothing and the weights end equal to
    those of the same run without it."""
    data = M.scenes(16)
    assert bool((data[1] == 0).any())
    plain = train(None, "make_depthnet", M.SILogLoss(), data, record=False, accum=2, bf16=True)
    recorded = train(out_dir, "make_depthnet", M.SILogLoss(), data, accum=2, bf16=True)
    assert not list(out_dir.glob("*.nan"))
    for (name, a), b in zip(plain.state_dict().items(), recorded.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_focal_length_of_0_zeroes_the_metric_depth_and_its_log_names_that_image(out_dir):
    """The metric head scales depth by the camera's focal length, an extra ``forward``
    argument; image 10's intrinsics were never filled (focal 0), so its depth is 0 and SILog's
    ``log(pred)`` is -inf there (step 2, row 2). ``log(gt)`` on the same line is -inf at every
    LiDAR hole of every image, which ``g[valid]`` drops: the report named all 4 images, as if
    the code hit the pole in each; it names image 2 alone now. Its hint says the focal length
    (``args[1]``) is 0 in that image alone: a blank record to fix, not a log to clamp."""
    img, depth, focal = M.scenes(16)
    focal[10] = 0
    err = raised(out_dir, "make_depthnet", M.SILogLoss(), (img, depth, focal))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.log", "-inf", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "g = torch.log(pred) - torch.log(gt)"), o
    assert "args[1] is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]
    assert "--try drop=2" in rep["hint"], rep["hint"]


def test_float16_sum_of_squared_log_errors_overflows_on_the_indoor_scan(out_dir):
    """Mixed-dataset training (MiDaS mixes indoor and outdoor sets) of a model kept in float16
    (``model.half()``, half images and depth, SGD with momentum): Eigen's per-image SILog sums
    the squared log errors of 4096 dense pixels in float16. At initialisation the outdoor
    images' sums stay below 65504; the indoor scan (image 1: step 0, row 1), whose depth is
    20x nearer than the head's initial guess, sums past it. The report names the sum, that
    image and float32 as the fix."""
    img, depth, focal = (t.half() for t in M.scenes(4, size=64, density=1.0))
    depth[1] *= 0.05
    model = M.make_depthnet().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    crit = M.PerImageSILog()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="depth_estimation_models:make_depthnet"):
            for x, d, f in DataLoader(TensorDataset(img, depth, focal), batch_size=BS):
                opt.zero_grad()
                crit(model(x, f), d).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], o["dtype"], rep["cause"]) == \
        ("<loss>", "aten.sum", "+inf", [1], "float16", "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "d2 = (d ** 2).sum((1, 2, 3))"), o
    assert "compute this op in float32" in rep["hint"], rep["hint"]


def test_gradient_matching_at_a_coarse_scale_with_no_lidar_point_names_the_image(out_dir):
    """MiDaS's gradient matching over 4 scales, each every ``2**k``-th pixel, reduced per
    image by its valid pixels without MiDaS's ``M.nonzero()`` guard. Sparse LiDAR covers
    every image at full resolution, but at stride 8 image 1's 4 remaining pixels hold no
    point: 0/0 at the first step, in that image only. The report named the line, not which
    of its runs (scales) made the 0/0, as it did for a module's loop; it says run 4 now."""
    img, depth, focal = M.scenes(16)
    every = [int((depth[i, 0, ::s, ::s] > 0).sum()) for s in (1, 8) for i in range(BS)]
    assert every[:BS].count(0) == 0 and [i for i in range(BS) if every[BS + i] == 0] == [1]
    err = raised(out_dir, "make_midas", M.SSIGradientLoss(), (img, depth, focal))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "return image_loss / m"), o
    assert o["line_run"] == 4, o  # (the 4th scale, stride 8: said by the loss's re-run)
    assert "skip the rows where it is 0" in rep["hint"], rep["hint"]


def test_adabins_chamfer_over_a_frame_without_lidar_points_names_the_blank_depth(out_dir):
    """AdaBins (``forward`` returns ``(bin_edges, depth)``): SILog plus the chamfer loss
    between each image's bin centres and its valid depths, written by hand. A frame with no
    LiDAR point (image 6: step 1, row 2) has every centre's nearest point the ``masked_fill``
    inf (a fill the loss means) and its points' mean is 0/0. The report names the division,
    that image, and the depth map (the loss's ``loss_args[1]``) as 0 everywhere in it: a
    record to filter, not an eps to add. Without that frame the run trains (under bfloat16
    autocast, accumulating 2 batches): the fill's inf at every hole is no event."""
    img, depth, focal = M.scenes(16)
    train(out_dir / "healthy", "make_adabins", M.AdaBinsLoss(), (img, depth, focal),
          accum=2, bf16=True)  # (the masked_fill's inf at every hole stays inside the loss)
    assert not list((out_dir / "healthy").glob("*.nan"))
    depth[6] = 0
    err = raised(out_dir, "make_adabins", M.AdaBinsLoss(), (img, depth, focal))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", [2], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "(to_bins * valid).sum(1) / valid.sum(1)"), o
    assert "loss_args[1] is 0 everywhere in sample(s) 2" in rep["hint"], rep["hint"]
    assert "--try drop=2" in rep["hint"], rep["hint"]
