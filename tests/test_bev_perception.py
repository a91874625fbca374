"""End to end on a Lift-Splat-Shoot / BEVDet camera-only BEV segmenter
(``bev_perception_models``): multi-camera images with rotations, translations and intrinsics
passed into forward (the frustum taken to the ego frame through ``inverse(K)``), a softmax
over depth bins times the context features, voxel pooling with LSS's cumsum trick, a BEV
encoder, a class-imbalanced BCE or focal loss under a visibility mask, camera dropout,
AdamW with gradient clipping, bfloat16 autocast, batches from a DataLoader. Each planted bug
of the domain fires under the recorder and is replayed with the CLI; the healthy version
raises no event and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import bev_perception_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("bev_perception_models.py", text)


def train(make: str, out_dir, bad: int | None = None, plant: str = "", steps: int = 2,
          record: bool = True, bf16: bool = False, eps: float = 1e-8, dropout: float = 0.0,
          **loss):
    """LSS's recipe: AdamW, clip_grad_norm_(5), batches of 4 from a DataLoader, the loss on
    the float32 logits of a (bfloat16-autocast, ``bf16``) forward; the planted sample ``bad``
    (its index in the batch) is in the last step's batch."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-7, eps=eps)
    crit = M.BEVSegLoss(**loss)
    ds = M.BEVDataset(4 * steps, bad=bad, plant=plant, bad_from=4 * (steps - 1), dropout=dropout)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"bev_perception_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for imgs, rots, trans, intrins, keep, target, visibility in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(imgs, rots, trans, intrins, keep)
            loss_fn(logits.float(), target, visibility).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_missing_calibration_is_named_as_the_input_the_voxelisation_swallowed(tmp_path):
    """A calibration record missing for camera 2 of sample 2 (its intrinsics NaN): the
    frustum's points in the ego frame are NaN, ``.long()`` makes them out-of-range voxel
    indices and the pooling drops them, so the outputs stay finite. An input event at step 1;
    the replay names that sample and (it advised ``allow_nan`` for a model that imputes the
    NaN) the cast to int64 that lost camera 2's view in silence."""
    ev, bundle = fire("make_lss", tmp_path, bad=2, plant="nan_calib")
    assert (ev["step"], ev["phase"], ev["kind"]) == (1, "input", "nan"), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["phase"], rep["origin"]["samples"]) == (
        "input", "input", [2]), rep["origin"]
    # (it advised allow_nan for a model that imputes the NaN: the voxelisation's cast lost it)
    cast = line_of("geom = ((geom - (self.bx - self.dx / 2.0)) / self.dx).long()")
    assert f"the forward cast it to int64 at {cast}" in rep["hint"], rep["hint"]
    assert "allow_nan" not in rep["hint"], rep["hint"]


def test_sample_with_every_camera_dropped_names_the_per_sample_visible_count(tmp_path):
    """Camera dropout drops all three cameras of sample 1: no cell is visible, and the loss
    normalised per sample by its visible cells is 0/0. The replay names the division in the
    loss, that sample, and the empty mask (a count to floor or records to filter)."""
    ev, bundle = fire("make_lss", tmp_path, bad=1, plant="all_dropped", per_sample=True)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "nan", [1]), o
    assert o["source"] == line_of("return (cells.flatten(1).sum(1) / visibility.flatten(1)"), o
    assert rep["cause"] == "invalid" and "no valid entry" in rep["hint"], rep["hint"]
    assert "count.clamp(min=1)" in rep["hint"], rep["hint"]


def test_unscaled_hdr_frame_overflows_the_hand_written_depth_softmax(tmp_path):
    """Camera 0 of sample 3 delivers its 12-bit HDR frame unscaled (0-4095): the depth logits
    pass 88 and the hand-written depth softmax's exp overflows. The replay names the exp in
    the camera encoder, that sample, overflow, the softmax by hand and the out-of-scale data."""
    ev, bundle = fire("make_lss_manual_softmax", tmp_path, bad=3, plant="raw12")
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "camencode"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "camencode", "aten.exp", "+inf", [3]), o
    assert o["source"] == line_of("e = torch.exp(x)"), o
    assert rep["cause"] == "overflow" and "torch.softmax(s, dim)" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"], rep["hint"]


def test_log_of_a_cumsum_trick_voxel_sum_names_the_running_sum(tmp_path):
    """An 8-bit frame never normalised (camera 0 of sample 3) makes its depth distribution
    peaked (tail bins near 1e-31); a voxel reached only by such tail points has a positive
    depth mass, but LSS's cumsum trick takes it as a difference of two entries of one
    float32 running total, which rounds to 0, and the log-occupancy channel is -inf. The
    replay names the log in the root module, sample 3 (it said every sample), precision, and
    (it gave a variance's advice, E[x²] − E[x]²) the cumsum to replace by a direct segment
    sum."""
    ev, bundle = fire("make_lss_log_mass", tmp_path, bad=3, plant="raw")
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    # (the log ran over the whole batch's voxels, rows of no sample, and the BEV encoder's
    # BatchNorm made every sample's output NaN: the scatter into the canvas names sample 3)
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.log", "-inf", [3]), o
    assert o["source"] == line_of("x = torch.cat((x[:, :-1], torch.log(mass)), 1)"), o
    assert rep["cause"] == "precision", rep["cause"]
    assert f"cumulative sum (made at {line_of('x = x.cumsum(0)')})" in rep["hint"], rep["hint"]
    assert "index_add_" in rep["hint"] and "E[x²]" not in rep["hint"], rep["hint"]


def test_dropped_camera_features_normalised_with_eps_outside_the_root(tmp_path):
    """Camera 1 dropped in every sample zeroes its context features, and the features are
    L2-normalised as ``f / (sqrt(sum f²) + eps)``: finite forward, but sqrt's derivative at 0
    is infinite, so the backward is NaN. The replay names SqrtBackward0 in the camera encoder
    at that line, every sample, and the norm to take with torch.linalg.vector_norm."""
    ev, bundle = fire("make_lss_norm_outside", tmp_path, plant="dropped")
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "camencode", "SqrtBackward0", "nan", [0, 1, 2, 3]), o
    assert o["source"] == line_of("feats = feats / (feats.pow(2).sum(1, keepdim=True).sqrt()"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]


def test_adamw_eps_zero_on_a_never_seen_camera_embedding(tmp_path):
    """BEVFormer's learned per-camera embedding, camera 1 dropped in every sample (its row's
    gradient exactly 0), AdamW with eps=0: m / sqrt(v) is 0/0 for that row at the first
    update. An optimizer event at step 0; the replay names AdamW, eps=0 and row 1."""
    ev, bundle = fire("make_lss_cam_embed", tmp_path, plant="dropped", eps=0.0)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    rep = nanreplay_json(bundle, code=None)
    assert rep["cause"] == "optimizer", rep["cause"]
    assert "cams_embeds" in rep["hint"] and "with eps=0" in rep["hint"], rep["hint"]
    assert "row(s) 1 of 3" in rep["hint"], rep["hint"]


def test_healthy_bf16_run_with_camera_dropout_raises_nothing_and_trains_the_same(tmp_path):
    """Every guard on (the depth mass's log floored, F.normalize, eps 1e-8), bfloat16
    autocast, camera dropout, the focal loss: no event, and bit-identical weights with and
    without the recorder."""
    kw = dict(steps=3, bf16=True, dropout=0.3, focal=True)
    recorded = train("make_lss_full", tmp_path, **kw)
    plain = train("make_lss_full", tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
