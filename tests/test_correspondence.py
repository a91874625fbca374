"""Dense correspondence trained as those repos write it (``correspondence_models.py``):
unsupervised optical flow with warping, forward-backward occlusion masks, MS-SSIM and
edge-aware smoothness, RAFT's correlation pyramid and sequence loss, pose by soft-argmax with
OKS and dsntnn's losses; with a planted bug, the recorder fires at the planted step and
``nanreplay --json`` names the op, samples, cause and fix."""

from __future__ import annotations

import inspect
import json

import correspondence_models as C
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line_of(text: str, within=C) -> str:
    """``correspondence_models.py:N`` of the line holding ``text`` (in ``within``'s code)."""
    lines, first = inspect.getsourcelines(within)
    [n] = [i for i, line in enumerate(lines, max(first, 1)) if text in line]
    return f"correspondence_models.py:{n}"


def _train_pose(loss, out_dir):
    """Integral pose regression in batches of two until ``loss`` fails on the instance (5)
    annotated with area 0: (that index, the areas, the ``pytest.raises`` info)."""
    img, gt, vis, area = C.pose_data(8)
    bad = 5
    area[bad] = 0
    model = C.make_pose()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                            factory="correspondence_models:make_pose") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                outs = model(img[i:i + 2], vis[i:i + 2])
                rec.loss_fn(outs, gt[i:i + 2], vis[i:i + 2], area[i:i + 2]).backward()
                opt.step()
    return bad, area, info


def test_ms_ssim_s_negative_contrast_term_is_named_at_its_sample_not_its_scale(out_dir):
    """Unsupervised flow with pytorch-msssim's ``ms_ssim`` before its fix: the per-scale
    contrast-structure terms ``(B, C)`` are stacked into ``(levels, B, C)`` and raised to the
    scales' weights. A picket fence panned by one pixel warps (at the untrained net's
    near-zero flow) every stripe onto its neighbour's gap: its contrast term is negative, and
    a negative number to a fractional power is NaN. With two scales and batches of two, the
    stacked tensor's dim 0 reads as the batch: the report named the scale (sample 0), and
    ``drop=0`` stayed NaN. The op finder follows the samples' dimension through ``stack`` now
    and names the fence's pair."""
    fence = 5
    img1, img2 = C.video_pairs(8, fence=fence)
    model = C.make_tiny_flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = C.UnsupFlowLoss()
    negative = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="correspondence_models:make_tiny_flow"):
            for i in range(0, 8, 2):
                opt.zero_grad()
                flows = model(img1[i:i + 2], img2[i:i + 2])
                with torch.no_grad():  # the pairs whose finest contrast term is negative
                    warped = C.flow_warp(img2[i:i + 2], flows[0])
                    cs = C._ssim_cs(warped, img1[i:i + 2])[1]
                    negative.append((cs < 0).any(1).nonzero()[:, 0].tolist())
                crit(flows, img1[i:i + 2], img2[i:i + 2]).backward()
                opt.step()
    ev = info.value.event
    step = fence // 2
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>"), ev
    assert negative == [[]] * step + [[fence % 2]], negative
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.pow", "nan", negative[-1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.prod(vals ** w", C.ms_ssim), o["source"]
    assert "negative number to a fractional power" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={fence % 2}", True)], \
        rep["what_if"]


def test_raft_s_stacked_sequence_loss_names_the_image_without_valid_pixels(out_dir):
    """RAFT with its sequence loss vectorised over the iterations: the flow predictions
    stacked ``(iters, B, 2, H, W)``, each image's L1 averaged over its valid pixels. A crop
    whose valid map is empty (KITTI's sparse ground truth cropped to a region without LiDAR
    returns) makes 0/0 in its column of the ``(iters, B)`` per-image errors. With four
    iterations and batches of two, dim 0 is a multiple of the batch and the report named no
    sample (and with two, the iterations as samples). The op finder follows the samples
    from the stack through the reduction over each image's pixels to the division now."""
    img1, img2, flow, valid = C.flow_scenes(8)
    empty = 5
    valid[empty] = 0
    model = C.make_raft()
    assert model.iters == 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=C.stacked_sequence_loss, out_dir=out_dir,
                            factory="correspondence_models:make_raft") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                preds = model(img1[i:i + 2], img2[i:i + 2])
                rec.loss_fn(preds, flow[i:i + 2], valid[i:i + 2]).backward()
                opt.step()
    ev = info.value.event
    step = empty // 2
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>"), ev
    samples = (valid[2 * step:2 * step + 2].flatten(1).sum(1) == 0).nonzero()[:, 0].tolist()
    assert samples == [empty % 2]
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", samples, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("per_image = err /", C.stacked_sequence_loss), o["source"]
    assert "0 by 0" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={empty % 2}", True)], \
        rep["what_if"]


def test_a_pose_loss_flattening_joints_with_the_batch_names_the_zero_area_instance(out_dir):
    """Integral pose regression with dsntnn's Jensen-Shannon regulariser: each joint's target
    Gaussian is made in the loss, the joints flattened with the batch (``gt.reshape(-1, 2)``,
    ``(B * K, H, W)``), its width COCO's ``k * sqrt(area)``. An instance annotated with area
    0 gets Gaussians of width 0, all zeros, and their normalisation is 0/0. The report named
    no sample (rows ``B * K`` are no batch), so neither the degenerate record nor ``drop``:
    the op finder follows the samples through the reshape now (row ``r`` is sample
    ``r // K``), and, the targets being made of the data alone, says the record is bad."""
    bad, area, info = _train_pose(C.js_heatmap_loss, out_dir)
    ev = info.value.event
    step = bad // 2
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>"), ev
    samples = (area[2 * step:2 * step + 2] == 0).nonzero()[:, 0].tolist()
    assert samples == [bad % 2]
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", samples, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("return g / g.sum(", C.make_gauss), o["source"]
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={bad % 2}", True)], \
        rep["what_if"]


def test_oks_loss_of_an_instance_of_area_zero_names_the_degenerate_record(out_dir):
    """An OKS loss, ``exp(-d^2 / (2 s^2 k^2))`` with ``s^2`` the instance's area, on integral
    (soft-argmax) pose regression. An instance annotated with area 0 divides by 0: the forward
    is finite (``d^2 / 0`` is inf, ``exp(-inf)`` is 0), the backward of the division is NaN.
    The hint said only that div's derivative has a pole and to add an eps; the divisor needs
    no gradient (the annotation's area), so the report says now that the record is
    degenerate, to drop or skip it before the division, or make the divisor safe."""
    bad, area, info = _train_pose(C.oks_loss, out_dir)
    ev = info.value.event
    step = bad // 2
    assert (ev["step"], ev["phase"]) == (step, "backward"), ev
    samples = (area[2 * step:2 * step + 2] == 0).nonzero()[:, 0].tolist()
    assert samples == [bad % 2]
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "DivBackward0", "nan", samples, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == _line_of("e = d2 / (2 * area", C.oks_loss), o["source"]
    assert "divisor is exactly 0 there" in rep["hint"], rep["hint"]
    assert "drop or repair them" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [(f"drop={bad % 2}", True)], \
        rep["what_if"]
