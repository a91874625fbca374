"""Semantic segmentation and dense prediction trained as those repos write it
(``segmentation_models.py``): U-Nets with BatchNorm and ConvTranspose2d / bilinear
upsampling, cross entropy with ``ignore_index=255`` and class weights, focal and Dice losses,
a scale-invariant log depth loss over the pixels with ground truth, partial convolutions over
a mask passed to the forward; with a planted bug, the recorder fires at the planted step and
``nanreplay --json`` names the op, samples, cause and fix."""

from __future__ import annotations

import json

import pytest
import segmentation_models as M
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, model, opt, crit, batches, factory, **kw):
    """The loop under the recorder; returns its error and the batches it ran, in order."""
    seen = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw):
            for x, y, *more in batches:
                opt.zero_grad()
                out = model(x, *more)
                seen.append((x, y, out.detach()))
                crit(out, y).backward()
                opt.step()
    return info.value, seen


@pytest.mark.parametrize("masked_select", [False, True])
def test_a_log_of_zero_depth_among_the_masked_pixels_names_its_image(out_dir, masked_select):
    """Monocular depth (BTS / AdaBins): a U-Net with a ReLU on its depth, the SILog loss over
    the pixels with LiDAR ground truth, ``log(pred[valid]) - log(gt[valid])``. Image 5 holds
    a dark corner where the ReLU gives a depth of 0: log(0) = -inf. The boolean mask flattens
    the batch into one row of pixels, and the report named no sample ([]), so ``--try auto``
    had nothing to drop. The rows a mask picks are followed back to their images now (also
    through ``pred.masked_select(valid)``)."""
    imgs, depth = M.depth_scenes(8)
    imgs[5, :, :4, :4] = -6.0
    model = M.make_depth()
    with torch.no_grad():
        model.net.head.bias[0] = 2.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = M.SILogLoss(masked_select=masked_select)
    batches = [(imgs[i:i + 2], depth[i:i + 2]) for i in range(0, 8, 2)]
    err, seen = _train(out_dir, model, opt, crit, batches, "segmentation_models:make_depth")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    _, gt, pred = seen[-1]
    zero = ((pred == 0) & (gt > crit.min_depth)).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert zero == [1]
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.log", "-inf", zero, "invalid"), json.dumps(rep, indent=1)
    assert "clamp" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)], \
        rep["what_if"]


def _crops(imgs, labs, size: int = 8):
    """Random crops of ``size`` pixels, the same window for each pair (a joint transform),
    drawn from torch's RNG; a batch of two crops per step."""
    out = []
    for i in range(0, len(imgs), 2):
        y0, x0 = torch.randint(0, imgs.shape[-1] - size + 1, (2,)).tolist()
        win = (slice(None), slice(y0, y0 + size), slice(x0, x0 + size))
        out.append((imgs[i:i + 2][(slice(None), *win)], labs[i:i + 2][win]))
    return out


@pytest.mark.parametrize("background_weight", [0.0, 0.5])
def test_a_crop_with_no_weighted_target_says_which_of_ignore_index_or_weight(
        out_dir, background_weight):
    """Cross entropy with ``ignore_index=255`` and class weights, over random crops. One
    step's crops hold only background and the 255 borders of the objects next to them. With
    the background weighted 0 (training on the foreground classes only) the total target
    weight is 0 and the mean is 0/0; the hint said 'every target of the batch is ignored
    (ignore_index)', though 2 × 64 pixels minus the borders are background targets. It says
    which now: the targets left are all of a class weighted 0, or (with the background
    weighted 0.5, a crop all border) every target is ignore_index."""
    imgs, labs = M.scenes(8)
    torch.manual_seed(0)
    batches = _crops(imgs, labs)
    x, y = batches[2]
    y[y != M.IGNORE] = 0 if background_weight == 0 else M.IGNORE  # (no object in the crop)
    model = M.make_unet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    crit = torch.nn.CrossEntropyLoss(weight=torch.tensor([background_weight, 1.0, 1.0]),
                                     ignore_index=M.IGNORE)
    err, _ = _train(out_dir, model, opt, crit, batches, "segmentation_models:make_unet")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (a mean over no weighted target: every crop of the batch, "all N rows")
    assert (o["module"], o["op"], o["made"], o["all_samples"], rep["cause"]) == \
        ("<loss>", "aten.nll_loss2d_forward", "nan", True, "invalid"), json.dumps(rep, indent=1)
    kept = int((y != M.IGNORE).sum())
    if background_weight == 0:
        assert kept > 0
        assert f"the batch's {kept} targets that are not ignore_index (255) are all of " \
               "class 0, whose weight is 0" in rep["hint"], rep["hint"]
        assert "weight above 0" in rep["hint"] and "every target" not in rep["hint"]
    else:
        assert kept == 0
        assert "every target of the batch is ignore_index (255)" in rep["hint"], rep["hint"]
        assert "max(count, 1)" in rep["hint"], rep["hint"]


def test_a_dice_eps_that_float16_rounds_to_0_is_named_in_the_hint(out_dir):
    """A U-Net and its soft Dice loss trained in float16 (``model.half()``, half inputs), the
    Dice written for float32: ``(2 * inter + smooth) / (card + smooth + 1e-8)`` with no
    smooth. The head has collapsed its last class (bias -25), whose softmax probability
    float16 rounds to 0 everywhere; image 6 holds none of that class, so its Dice is 0/0.
    The hint told the user to clamp the denominator away from 0 with an eps, which the loss
    already adds: 1e-8 is 0 in float16. It says so now."""
    imgs, labs = M.scenes(8)
    labs[labs == M.IGNORE] = 0
    labs[6] = 0
    model = M.make_unet()
    with torch.no_grad():
        model.head.bias[:] = torch.tensor([0.0, 0.0, -25.0])
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = M.SoftDiceLoss(eps=1e-8)
    batches = [(imgs[i:i + 2].half(), labs[i:i + 2]) for i in range(0, 8, 2)]
    err, seen = _train(out_dir, model, opt, crit, batches, "segmentation_models:make_unet")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    y = seen[-1][1]
    absent = [j for j in range(len(y)) if not bool((y[j] == 2).any())]
    assert absent == [0]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", absent, "underflow"), json.dumps(rep, indent=1)
    assert "the eps 1e-08 added to that input is 0 in float16" in rep["hint"], rep["hint"]


def test_a_16_bit_image_under_float16_autocast_and_a_drop_deeplab_cannot_run(out_dir):
    """torchvision's DeepLabv3 recipe: dict outputs ``{"out", "aux"}`` and its criterion
    (passed as a function, called as ``rec.loss_fn``), float16 autocast with a GradScaler,
    SGD with weight decay and a poly schedule. Image 5 is a 16-bit scan never scaled to
    [0, 1]; autocast's cast of it to float16 overflows. The report names the cast, the
    image and its scale; ``--try auto``'s drop=1 leaves a batch of one, which the ASPP's
    image-pooling BatchNorm refuses: the try said only that the model raised a ValueError.
    It says now that the drop left one sample, which such a BatchNorm cannot normalise."""
    imgs, labs = M.scenes(8)
    imgs[5] = (imgs[5] + 1) * 30000.0
    model = M.make_deeplab()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: (1 - it / 4) ** 0.9)
    scaler = torch.amp.GradScaler("cpu")
    seen = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.criterion, out_dir=out_dir, scaler=scaler,
                            factory="segmentation_models:make_deeplab") as rec:
            for i in range(0, 8, 2):
                x, y = imgs[i:i + 2], labs[i:i + 2]
                seen.append(x)  # (the event of a step the scaler skips comes a step later)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = rec.loss_fn(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "backbone.0.0"), ev
    big = (seen[ev["step"]].flatten(1).amax(1) > torch.finfo(torch.float16).max).nonzero()[:, 0]
    assert big.tolist() == [1]
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("backbone.0.0", "aten._to_copy", "+inf", big.tolist(), "overflow"), \
        json.dumps(rep, indent=1)
    assert "out of scale" in rep["hint"], rep["hint"]
    tried = {t["try"]: t for t in rep["what_if"]}
    assert set(tried) == {"drop=1", "dtype=float32"} and tried["dtype=float32"]["finite"], \
        rep["what_if"]
    assert "(the drop left 1 of the batch's 2 samples: a BatchNorm in training mode cannot " \
           "normalise a batch of one" in tried["drop=1"]["error"], tried["drop=1"]


def test_an_inverse_depth_of_a_hole_masked_after_the_division_says_the_mask_came_late(out_dir):
    """L1 on inverse depth, ``(|1/pred - 1/gt| * valid).sum() / valid.sum()`` with
    ``valid = gt > 0``: the mask is applied after the division, so a LiDAR hole's 1/0 = inf
    is multiplied by 0, which is NaN. Images 0-4 have dense ground truth, image 5 has holes.
    The report named the reciprocal on image 5 and told the user to add an eps or skip the
    rows where it is 0, as if no mask were there; it says now that the product by the mask's
    0 came after the pole and made the NaN, and how to mask before it."""
    imgs, depth = M.depth_scenes(8)
    depth[:5] = depth[:5].clamp_min(1.0)
    model = M.make_depth(act="softplus")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = [(imgs[i:i + 2], depth[i:i + 2]) for i in range(0, 8, 2)]
    err, seen = _train(out_dir, model, opt, M.InverseDepthL1(), batches,
                       "segmentation_models:make_depth", factory_kwargs={"act": "softplus"})
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    holes = (seen[-1][1] == 0).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert holes == [1]
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.reciprocal", "+inf", holes, "invalid"), json.dumps(rep, indent=1)
    assert "then aten.mul (segmentation_models.py:" in rep["hint"], rep["hint"]
    assert "multiplied that infinity by a mask's 0, and inf * 0 is NaN" in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)], \
        rep["what_if"]
