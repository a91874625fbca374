"""Image restoration and anomaly detection trained as those repos write it
(``image_restoration_models.py``): NAFNet (zero-initialised residual scales: the identity at
initialisation) with BasicSR's Charbonnier and PSNR losses and pytorch-msssim's SSIM, an
EDSR-like SR net with ``PixelShuffle``, Deep SVDD with its centre ``c``, Patch SVDD over
``unfold``ed patches, FCDD's hypersphere classifier; paired patches through a DataLoader,
AdamW with a cosine schedule, an EMA of the weights, bfloat16 autocast. With a planted bug the
recorder fires at the planted step and ``nanreplay --json`` names the op, samples, cause and
fix; healthy runs on black and flat patches are not stopped."""

from __future__ import annotations

import inspect
import json

import image_restoration_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line_of(text: str, within=M) -> str:
    """``image_restoration_models.py:N`` of the line holding ``text`` (in ``within``'s code)."""
    lines, first = inspect.getsourcelines(within)
    [n] = [i for i, line in enumerate(lines, max(first, 1)) if text in line]
    return f"image_restoration_models.py:{n}"


def _train_pairs(out_dir, model, crit, lq, gt, factory, *, clip=None):
    """BasicSR's loop over a paired patch dataset (dict batches of two), AdamW with a cosine
    schedule, until the recorder raises; returns its error."""
    loader = torch.utils.data.DataLoader(M.PatchPairs(lq, gt), batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory) as rec:
            for data in loader:
                opt.zero_grad()
                rec.loss_fn(model(data["lq"]), data["gt"]).backward()
                opt.step()
                sched.step()
    return info.value


def _blind_denoising(clean_at: int):
    """Blind denoising pairs whose patch ``clean_at`` drew noise level 0 (DnCNN-B's range
    starts at 0): its noisy patch is its clean one."""
    sigmas = [15, 25, 30, 10, 20, 5, 40, 35]
    sigmas[clean_at] = 0
    noisy, clean = M.noisy_pairs(8, sigmas=sigmas)
    assert torch.equal(noisy[clean_at], clean[clean_at])
    return noisy, clean


def test_charbonnier_with_eps_0_says_the_eps_is_0_at_the_sqrt_backward(out_dir):
    """BasicSR's ``CharbonnierLoss`` with ``eps: 0`` in the option file, on NAFNet, whose
    zero-initialised ending conv makes it return its input exactly at step 0: a patch that
    drew noise level 0 is reproduced exactly, ``sqrt(d ** 2 + 0)`` is at 0 and its backward
    is inf * 0. The hint said to "add an eps" to a user whose loss adds one; it says that
    eps is exactly 0 now."""
    noisy, clean = _blind_denoising(clean_at=1)
    crit = M.CharbonnierLoss(eps=0.0)
    err = _train_pairs(out_dir, M.make_nafnet(), crit, noisy, clean,
                       "image_restoration_models:make_nafnet")
    assert (err.event["step"], err.event["phase"]) == (0, "backward"), err.event
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "SqrtBackward0", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.sqrt((pred - target) ** 2", M.CharbonnierLoss)
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)], \
        rep["what_if"]


def test_psnr_loss_with_eps_0_on_an_exact_reproduction_says_the_eps_is_0(out_dir):
    """NAFNet's ``PSNRLoss`` ported as ``log(mse + eps)`` with ``eps = 0``: the patch the
    identity-initialised net reproduces exactly has ``mse = 0`` and ``log(0) = -inf``, in the
    loss's forward. The report names the log, the patch, and that the eps is 0."""
    noisy, clean = _blind_denoising(clean_at=1)
    err = _train_pairs(out_dir, M.make_nafnet(), M.PSNRLoss(eps=0.0), noisy, clean,
                       "image_restoration_models:make_nafnet")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.log", "-inf", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.log(mse + self.eps)", M.PSNRLoss), o["source"]
    assert "log of 0" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]


def test_ssim_with_c1_c2_0_on_a_black_region_names_the_0_by_0_and_the_zero_constant(out_dir):
    """Deblurring with an SSIM loss whose ``K1, K2`` were set to 0: a patch with a black
    region (a night sky) stays black when blurred, the identity-initialised NAFNet returns it,
    and on windows flat in both images ``(2 sigma12 + C2) / (sigma1 + sigma2 + C2)`` is 0/0.
    The report names the division, the patch, and that the added constant is 0."""
    gt = M.clean_patches(8, 16)
    gt[1, :, :8] = 0.0
    blur = torch.ones(3, 1, 3, 3) / 9
    lq = F.conv2d(F.pad(gt, (1, 1, 1, 1), mode="replicate"), blur, groups=3)
    err = _train_pairs(out_dir, M.make_nafnet(), M.SSIMLoss(k=(0.0, 0.0)), lq, gt,
                       "image_restoration_models:make_nafnet")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.div", "nan", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("cs_map = (2 * sigma12 + c2)", M.ssim), o["source"]
    assert "0 by 0" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)], \
        rep["what_if"]


def test_ms_ssim_under_bfloat16_autocast_on_a_flat_patch_is_precision_not_invalid(out_dir):
    """pytorch-msssim's ``ms_ssim`` (before its ``relu``) inside the loop's bfloat16 autocast:
    the Gaussian-filter convs run in bfloat16, and on a flat grey wall the variances
    ``E[x^2] - mu^2`` cancel to rounding noise, so a contrast-structure term comes out
    negative; raised to its scale's fractional weight it is NaN. The report names the power
    on that patch (its column of the stacked ``(levels, B, C)`` terms), as precision, not
    invalid math, and points at the bfloat16 convs before it."""
    torch.manual_seed(0)
    gt = M.clean_patches(8, 32)
    gt[3] = 0.43
    lq = gt + 0.002 * torch.randn(gt.shape)
    model = M.make_nafnet()
    loader = torch.utils.data.DataLoader(M.PatchPairs(lq, gt), batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.MSSSIMLoss(), out_dir=out_dir,
                            factory="image_restoration_models:make_nafnet") as rec:
            for data in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = rec.loss_fn(model(data["lq"]), data["gt"])
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.pow", "nan", [1], "precision"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.prod(vals ** w", M.ms_ssim), o["source"]
    assert "negative number to a fractional power" in rep["hint"], rep["hint"]
    assert "bfloat16 autocast" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == \
        [("drop=1", True), ("dtype=float32", True)], rep["what_if"]


def test_ssim_on_rgb_range_255_under_float16_autocast_names_the_overflow_of_2_mu1_mu2(out_dir):
    """EDSR's ``rgb_range 255`` (8-bit values as they are) with an SSIM loss for
    ``data_range=255`` under float16 autocast and a GradScaler: the Gaussian-filter convs run
    in float16, and on the blown-out sky of a dim scene (250) ``2 * mu1 * mu2`` is past
    float16's 65504; inf over inf is NaN. The report names that product on that image as an overflow the float32
    re-run does not make (not the division's inf/inf), and says to compute it in float32 or
    rescale."""
    hr = M.clean_patches(8, 16) * 180  # (dim scenes: 2 * 162^2 is finite in float16)
    hr[5, :, :8] = 250.0
    lr = F.avg_pool2d(hr, 2)
    model = M.make_srnet(255.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    crit = M.SSIMLoss(alpha=0.0, data_range=255.0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                            factory="image_restoration_models:make_srnet",
                            factory_kwargs={"rgb_range": 255.0}) as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = rec.loss_fn(model(lr[i:i + 2]), hr[i:i + 2])
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.mul", "+inf", [1], "overflow"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("ssim_map = ((2 * mu1_mu2 + c1)", M.ssim), o["source"]
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "compute this op in float32" in rep["hint"], rep["hint"]
    assert ("dtype=float32", True) in [(t["try"], t["finite"]) for t in rep["what_if"]]


def test_deep_svdd_s_nan_centre_from_an_empty_loader_is_named_as_the_loss_s_buffer(out_dir):
    """deep-SVDD-pytorch's ``init_center_c`` over a loader that yielded nothing (the normal
    class filtered out by a label of the wrong type): ``c /= n_samples`` is 0/0, every entry
    of the centre NaN, and the first loss NaN. The report had no op, no line, and told the
    user to check the loss inputs (targets, log of zero probabilities); it names the ``z - c``
    that took the loss's NaN buffer ``c`` now, made before the step."""
    x = M.digits(8)
    model = M.make_lenet()
    c = M.init_center_c(model, [])
    assert bool(c.isnan().all())
    crit = M.DeepSVDDLoss(c)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-6)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="image_restoration_models:make_lenet") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                rec.loss_fn(model(x[i:i + 2])).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.sub", "nan", [0, 1], "weights"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.sum((z - self.c) ** 2", M.DeepSVDDLoss), o["source"]
    assert "the loss's 'c' holding nan" in rep["hint"], rep["hint"]
    assert "empty loader" in rep["hint"] and "check the loss inputs" not in rep["hint"]


def test_a_centre_buffer_the_loop_set_nan_before_training_is_said_so_and_torch_mean_replays(
        out_dir):
    """A Deep SVDD port that keeps ``c`` in the network (a buffer the factory builds as
    zeros) and returns the distances, trained with ``loss_fn=torch.mean``; the loop copies in
    the centre from ``init_center_c`` over an empty loader, NaN. The hint said to find what
    writes weights outside ``optimizer.step()`` and resume from an earlier checkpoint, at the
    first step; it says now that the loop wrote the buffer before training. And ``torch.mean``
    was described by its qualname (``torch._VariableFunctionsClass.mean``), which imports
    nothing, so the loss was not re-run: it is ``torch:mean`` now."""
    x = M.digits(8)
    model = M.make_svdd_net()
    model.c.copy_(M.init_center_c(model.encoder, []))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-6)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.mean, out_dir=out_dir,
                            factory="image_restoration_models:make_svdd_net") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                rec.loss_fn(model(x[i:i + 2])).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["params"], o["tensor"], o["op"], o["samples"], rep["cause"]) == \
        ("weights", ["c"], "buffer", "aten.sub", [0, 1], "weights"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.sum((self.encoder(x) - self.c) ** 2", M.SVDDNet)
    assert rep["hint"].startswith("the factory builds buffer c finite"), rep["hint"]
    assert "empty loader" in rep["hint"] and "earlier checkpoint" not in rep["hint"]
    assert not any("cannot be imported" in p for p in rep["problems"]), rep["problems"]


def test_patch_svdd_s_flat_patch_is_named_by_its_image_not_its_patch_row(out_dir):
    """Patch SVDD standardises each ``unfold``ed patch without an eps: a blank corner of one
    image is a flat patch, 0/0 in ``norm``, whose input rows are the ``B x patches`` crops.
    The report names the image (row 1 of the batch at step 2), not the crop's row."""
    x = M.digits(8)
    x[5, :, 8:, 8:] = 0.0
    model = M.make_patch_svdd()
    with torch.no_grad():
        c = model(x[:4]).mean((0, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-6)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.DeepSVDDLoss(c), out_dir=out_dir,
                            factory="image_restoration_models:make_patch_svdd") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                rec.loss_fn(model(x[i:i + 2])).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "norm"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.div", "nan", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("return (p - mean) / std", M.PatchStandardize)
    assert "0 by 0" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)]


def test_fcdd_s_own_indexed_hsc_with_eps_0_names_the_blank_anomaly_by_its_batch_row(out_dir):
    """FCDD's own ``hsc`` loss writes the anomalies' ``-log(1 - exp(-score) + eps)`` back by
    boolean index. With ``eps = 0`` a blank outlier-exposure image (the bias-free net's
    ``A = 0``, score 0) makes ``log(0)``, computed on the anomalies' rows alone: the report
    names that image by its row of the batch (1), not its row among the anomalies (0), and
    says the eps is 0."""
    x = M.digits(8)
    labels = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1])
    x[7] = 0.0
    model = M.make_fcdd()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.FCDDHSCLoss(eps=0.0), out_dir=out_dir,
                            factory="image_restoration_models:make_fcdd") as rec:
            for i in range(0, 8, 2):
                opt.zero_grad()
                rec.loss_fn(model(x[i:i + 2]), labels[i:i + 2]).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.log", "-inf", [1], "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("anom = -(((1 - (-loss[labels == 1]).exp())", M.FCDDHSCLoss)
    assert "exactly 0" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)]


def test_grad_scaler_s_skipped_steps_under_float16_autocast_are_not_events(out_dir):
    """NAFNet under float16 autocast with a GradScaler started far too high (2^40): every
    scaled backward overflows and the scaler skips the update and halves its scale. Those
    are the scaler's business, not events: the run goes on."""
    gt = M.clean_patches(8, 16)
    lq = gt + 0.1 * torch.randn(gt.shape, generator=torch.Generator().manual_seed(3))
    model = M.make_nafnet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    crit = M.CharbonnierLoss(eps=1e-6)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                        factory="image_restoration_models:make_nafnet") as rec:
        for i in [0, 2, 4, 6, 0, 2]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = rec.loss_fn(model(lq[i:i + 2]), gt[i:i + 2])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert rec.event is None and rec.step == 6, rec.event
    assert scaler.get_scale() < 2.0 ** 40  # (the scaler did skip)


def test_healthy_restoration_and_svdd_runs_on_black_patches_are_not_stopped(out_dir):
    """The same models with their eps's kept: NAFNet on blurred patches with black regions
    (Charbonnier + SSIM, bfloat16 autocast, gradient clipping, an EMA of the weights made
    and evaluated inside the recording), and Deep SVDD's soft-boundary objective with its
    radius updated from the distances' quantile, over a blank image. No event, every step
    closed."""
    gt = M.clean_patches(8, 16)
    gt[1, :, :8] = 0.0
    gt[4] = 0.0
    lq = F.avg_pool2d(F.pad(gt, (1, 1, 1, 1), mode="replicate"), 3, 1)
    model = M.make_nafnet()
    pix, ssim = M.CharbonnierLoss(), M.SSIMLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(M.PatchPairs(lq, gt), batch_size=2)
    with FlightRecorder(model, opt, out_dir=out_dir,
                        factory="image_restoration_models:make_nafnet") as rec:
        ema = torch.optim.swa_utils.AveragedModel(  # (a deep copy of the recorded model)
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.999))
        for _ in range(2):
            for data in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(data["lq"])
                loss = pix(out.float(), data["gt"]) + ssim(out.float(), data["gt"])
                rec.record_loss(loss)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
                opt.step()
                ema.update_parameters(model)
                with torch.no_grad():
                    assert torch.isfinite(ema(gt[4:5])).all()
    assert rec.event is None and rec.step == 8, rec.event

    x = M.digits(8)
    x[3] = 0.0
    net = M.make_lenet()
    crit = M.DeepSVDDLoss(M.init_center_c(net, [x[:4], x[4:]]), nu=0.1,
                          objective="soft-boundary")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with FlightRecorder(net, opt, loss_fn=crit, out_dir=out_dir,
                        factory="image_restoration_models:make_lenet") as rec:
        for epoch in range(3):
            for i in range(0, 8, 4):
                opt.zero_grad()
                z = net(x[i:i + 4])
                rec.loss_fn(z).backward()
                opt.step()
                if epoch >= 1:  # (after the warm-up epochs)
                    dist = torch.sum((z.detach() - crit.c) ** 2, dim=1)
                    crit.R.fill_(torch.quantile(dist.sqrt(), 1 - crit.nu))
    assert rec.event is None and rec.step == 6 and float(crit.R) > 0, rec.event
