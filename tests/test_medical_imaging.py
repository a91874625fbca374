"""3D medical imaging trained as that community writes it (``medical_imaging_models.py``): a 3D
U-Net on random patches cropped inside the Dataset in DataLoader workers, Dice-family losses
over one-hot labels, VoxelMorph-style registration under bfloat16 autocast, with a planted
bug: the recorder fires at the planted step and ``nanreplay --json`` names the op, samples,
cause and fix."""

from __future__ import annotations

import json

import medical_imaging_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.mark.parametrize("batch_dice", [True, False])
def test_a_batch_dice_weight_of_a_class_absent_from_the_batch_names_no_sample(out_dir,
                                                                             batch_dice):
    """Binary segmentation (background + lesion, two classes) in batches of two patches, the
    generalized Dice weighting each class by 1 / volume² without MONAI's guard; batch 1's
    scans hold no lesion. Summed over the batch (``batch=True``, MONAI's option) the weights
    are one per class, shape (2,): the lesion's +inf was named as sample [1] (its class
    index, read as a row of a batch of 2) and ``--try auto`` dropped that sample, which
    changed nothing. A value pooled over the batch names no sample now; the per-sample
    weights (B, C) still name both patches."""
    vols, labs = M.phantom(4, size=16)
    labs = (labs > 0).long()
    labs[2:] = 0
    vols[2:] = 0.1 * torch.randn(vols[2:].shape)
    model = M.make_unet(n_classes=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.GeneralizedDiceLoss(batch=batch_dice)
    torch.manual_seed(0)
    loader = DataLoader(M.RandomPatches(vols, labs, patch=12), batch_size=2, num_workers=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="medical_imaging_models:make_unet",
                            factory_kwargs={"n_classes": 2}):
            for vol, lab in loader:
                opt.zero_grad()
                crit(model(vol), lab).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.reciprocal", "+inf", "invalid"), \
        json.dumps(rep, indent=1)
    assert o["samples"] == ([] if batch_dice else [0, 1]), o
    assert not any(t["try"].startswith("drop=") for t in rep["what_if"]), rep["what_if"]


def test_a_similarity_loss_outside_the_forwards_autocast_is_replayed_in_float32(out_dir):
    """VoxelMorph under bfloat16 autocast, the loss outside it in float32 as the AMP recipe
    says (``crit((moved.float(), flow.float()), fixed)``): local NCC from box-filter sums,
    the correlation as cross / (sqrt(var_I) sqrt(var_J) + eps), the variances as
    E[x²] − E[x]². Pair 3 holds a region saturated at 0.9, where float32 cancels the
    variance to -0.00029 and sqrt makes NaN. The replay ran the loss under the forward's
    bfloat16 autocast: the variance was -1, 'no value left bfloat16's range', and
    ``--try auto`` proposed dtype=float32, the type the loss already ran in. The loss call's
    own autocast is recorded now, and the replay runs it as it ran."""
    moving, fixed = M.brain_pairs(4)
    moving[3, :, :8, :8, :8] = fixed[3, :, :8, :8, :8] = 0.9
    model = M.make_vxm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.RegistrationLoss(M.NCC(sqrt_eps=1e-5))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="medical_imaging_models:make_vxm"):
            for mov, fix in DataLoader(TensorDataset(moving, fixed), batch_size=2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    moved, flow = model(mov, fix)
                loss = crit((moved.float(), flow.float()), fix)
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    meta, _ = read_bundle(info.value.bundle_path)
    mb = meta["micro_batches"][0]
    assert (mb["autocast"], mb["loss_autocast"]) == ({"cpu": "bfloat16"}, {}), mb
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.sqrt", [1], "precision"), json.dumps(rep, indent=1)
    assert -1e-3 < o["chain"][0]["input_min"] < 0, o["chain"]
    assert "float32's range" in rep["hint"] and "bfloat16" not in rep["hint"], rep["hint"]
    # float64 is tried (not float32, the type the loss ran in), and fails: the saturated
    # region's variance is 0 in exact arithmetic, so sqrt's backward is infinite in any type
    tries = {t["try"]: t for t in rep["what_if"]}
    assert list(tries) == ["drop=1", "dtype=float64"], json.dumps(rep["what_if"], indent=1)
    assert tries["drop=1"]["finite"] and not tries["dtype=float64"]["finite"], tries


def _deep_supervision_run(out_dir, crit, background_bias: float | None = None):
    """A U-Net with deep supervision, its loss ``crit`` summed over the decoder levels in
    the loop, coarsest first, against labels resized to each level (one call of the loss per
    level). Scan 3's lesion is a single voxel at an odd index, which the half-resolution
    labels miss. ``background_bias``: both heads' background logit bias (a head collapsed
    onto the background). Returns the recorder's error."""
    vols, labs = M.phantom(4, size=12)
    labs = (labs > 0).long()
    labs[3] = 0
    labs[3, 5, 5, 5] = 1
    model = M.make_unet_deep_supervision(n_classes=2)
    if background_bias is not None:
        with torch.no_grad():
            model.head.bias[0] = model.aux.bias[0] = background_bias
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="medical_imaging_models:make_unet_deep_supervision",
                            factory_kwargs={"n_classes": 2}):
            for vol, lab in DataLoader(TensorDataset(vols, labs), batch_size=2):
                opt.zero_grad()
                loss = 0
                for w, out in zip((0.5, 1.0), reversed(model(vol))):
                    lab_i = F.interpolate(lab[:, None].float(), size=out.shape[2:],
                                          mode="nearest")[:, 0].long()
                    loss = loss + w * crit(out, lab_i)
                loss.backward()
                opt.step()
    return info.value


def test_deep_supervision_summed_in_the_loop_replays_the_level_whose_loss_went_bad(out_dir):
    """A U-Net with deep supervision, its loss summed over the decoder levels in the loop,
    coarsest first, against labels resized to each level (one call of the loss per level).
    Scan 3's lesion is a single voxel at an odd index, which the half-resolution labels miss:
    the generalized Dice weight of the absent lesion class is 1/0 at that level only. The
    bundle held the arguments of the last loss call (full resolution, finite), so the replay
    said 'not reproduced' and blamed state outside the model. The recorder now keeps the call
    whose loss went bad."""
    err = _deep_supervision_run(out_dir, M.GeneralizedDiceLoss())
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and (o["op"], o["samples"], rep["cause"]) == \
        ("aten.reciprocal", [1], "invalid"), json.dumps(rep, indent=1)


def test_deep_supervision_summed_in_the_loop_replays_the_level_whose_backward_went_bad(
        out_dir):
    """The same loop with the focal Tversky loss, (1 - TI)^0.75, and a head collapsed onto
    the background (its logit 30 above the lesion's: softmax rounds the background to 1).
    Scan 3's half-resolution labels are all background: there TI rounds to exactly 1, and
    the derivative of (1 - TI)^0.75 at 0 is infinite (finite in float64, where TI < 1). Its
    forward is finite; the NaN comes in the backward of the coarse level's call. The replay
    re-ran the last call's (finite) backward and told the user to compute the whole loss
    inside loss_fn, which it was. The bundle now keeps the call that took the output whose
    gradient went bad."""
    err = _deep_supervision_run(out_dir, M.FocalTverskyLoss(), background_bias=30.0)
    ev = err.event
    assert (ev["step"], ev["phase"]) == (1, "backward"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "PowBackward0", [1], "precision"), json.dumps(rep, indent=1)
    assert not rep["problems"], rep["problems"]


def test_a_healthy_amp_deep_supervision_run_on_random_patches_is_untouched(out_dir):
    """nnU-Net's recipe on clean data: random patches cropped in DataLoader workers, the model
    and its inputs in channels_last_3d, the forward under bfloat16 autocast, the loss summed
    over the decoder levels in the loop (two calls a step, both kept by the recorder), SGD
    with Nesterov momentum and gradient clipping. No event, and the losses are those of the
    same run without the recorder."""
    vols, labs = M.phantom(8, size=16)

    def train(record: bool) -> list[float]:
        model = M.make_unet_deep_supervision().to(memory_format=torch.channels_last_3d)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.99, nesterov=True)
        crit, losses = M.TverskyLoss(), []
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                             factory="medical_imaging_models:make_unet_deep_supervision")
        if record:
            rec.attach()
        torch.manual_seed(0)
        loader = DataLoader(M.RandomPatches(vols, labs, patch=12), batch_size=4, shuffle=True,
                            num_workers=2)
        for _ in range(2):
            for vol, lab in loader:
                vol = vol.contiguous(memory_format=torch.channels_last_3d)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs = model(vol)
                    loss = 0
                    for w, out in zip((1.0, 0.5), outs):
                        lab_i = F.interpolate(lab[:, None].float(), size=out.shape[2:],
                                              mode="nearest")[:, 0].long()
                        loss = loss + w * crit(out, lab_i)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 12)
                opt.step()
                losses.append(loss.item())
        if record:
            rec.detach()
        return losses

    assert train(record=True) == train(record=False)  # (an event would have raised)
    assert not out_dir.exists() or not any(out_dir.glob("*.nan"))


def test_a_batch_tversky_pole_in_backward_names_the_samples_not_a_class(out_dir):
    """The focal Tversky loss per class over the batch (``batch=True``), binary segmentation
    in batches of two, a head collapsed onto the background; batch 1's two patches are all
    background, so the background's TI over the batch rounds to exactly 1 and the derivative
    of (1 - TI)^0.75 at 0 is infinite. That gradient, shape (2,) per class, was read as rows
    of the batch: sample [0] (the background's index), and ``--try auto`` dropped it, which
    changed nothing. A gradient of a value pooled over the batch names no sample now; the
    samples are those whose gradient the loss sent into the model output went bad."""
    vols, labs = M.phantom(4, size=12)
    labs = (labs > 0).long()
    labs[2:] = 0
    vols[2:] = 0.1 * torch.randn(vols[2:].shape)
    model = M.make_unet(n_classes=2)
    with torch.no_grad():
        model.head.bias[0] = 30.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.FocalTverskyLoss(batch=True)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="medical_imaging_models:make_unet",
                            factory_kwargs={"n_classes": 2}):
            for vol, lab in DataLoader(TensorDataset(vols, labs), batch_size=2):
                opt.zero_grad()
                crit(model(vol), lab).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (1, "backward")
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "PowBackward0", [0, 1], "precision"), json.dumps(rep, indent=1)
    assert not any(t["try"].startswith("drop=") for t in rep["what_if"]), rep["what_if"]


def test_voxelmorphs_loss_method_of_a_plain_class_is_rebuilt_and_replayed(out_dir):
    """VoxelMorph's scripts take the loss as a method of a plain class,
    ``image_loss = vxm.losses.NCC(win=[5, 5, 5]).loss``, called through ``rec.loss_fn`` on the
    fixed and warped images (the smoothness term added in the loop). A region saturated at
    0.9 cancels the local variance below 0 and sqrt makes NaN. The replay said the loss
    function 'cannot be imported by its name' and did not re-run it, though its class
    imports; the bundle now describes the instance (class, method, JSON attributes) and the
    replay rebuilds it without calling the constructor, and names the op."""
    moving, fixed = M.brain_pairs(4)
    moving[3, :, :8, :8, :8] = fixed[3, :, :8, :8, :8] = 0.9
    model = M.make_vxm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    image_loss, smooth = M.PlainNCC(win=[5, 5, 5]).loss, M.Grad3d()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=image_loss, out_dir=out_dir,
                            factory="medical_imaging_models:make_vxm") as rec:
            for mov, fix in DataLoader(TensorDataset(moving, fixed), batch_size=2):
                opt.zero_grad()
                moved, flow = model(mov, fix)
                loss = rec.loss_fn(fix, moved) + 0.01 * smooth(flow)
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (1, "loss")
    meta, _ = read_bundle(info.value.bundle_path)
    assert {k: meta["loss"].get(k) for k in ("import", "method", "state")} == {
        "import": "medical_imaging_models:PlainNCC", "method": "loss",
        "state": {"win": [5, 5, 5], "eps": 1e-5}}, meta["loss"]
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.sqrt", [1], "precision"), json.dumps(rep, indent=1)
    assert not rep["problems"], rep["problems"]
