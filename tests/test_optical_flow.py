"""Optical flow trained as RAFT and UnFlow train it (``optical_flow_models``): RAFT's
correlation pyramid, ``grid_sample`` lookups, ConvGRU and convex upsampling under its own
``sequence_loss`` on KITTI-like sparse ground truth (AdamW, OneCycleLR, clipping, float16
autocast with a GradScaler), and an unsupervised net run both ways under UnFlow's census /
occlusion-masked generalised Charbonnier loss with gradient accumulation. Each planted bug of
the domain fires under the recorder and is replayed with the CLI; the healthy runs raise no
event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import optical_flow_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              # (the GradScaler's skipped first steps, as in RAFT's own training)
              pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")]


def line_of(text: str) -> str:
    return source_line("optical_flow_models.py", text)


def train_raft(make: str, out_dir, steps: int = 3, record: bool = True, fp16: bool = False,
               invalid: str = "zero", bad: int | None = None, sixteen_bit: int | None = None):
    """RAFT's ``train.py``: AdamW, OneCycleLR, the loss outside autocast, the GradScaler
    unscaled before the clipping. In the last step's batch, sample ``bad`` stores missing
    flow as ``invalid`` and sample ``sixteen_bit`` is a frame pair read from 16-bit PNGs
    (values up to 65535, not 255)."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=1e-5, eps=1e-8)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 4e-4, steps + 100, pct_start=0.05,
                                                cycle_momentum=False, anneal_strategy="linear")
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.sequence_loss, out_dir=out_dir, scaler=scaler,
                         factory=f"optical_flow_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.sequence_loss
        for step in range(steps):
            last = step == steps - 1
            img1, img2, flow, valid = M.kitti_batch(
                g, invalid=invalid if last or bad is None else "zero", bad=bad if last else None)
            if last and sixteen_bit is not None:
                img1[sixteen_bit] *= 257
                img2[sixteen_bit] *= 257
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                preds = model(img1, img2, iters=3)
            loss = loss_fn(preds, flow, valid)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
    return model


def train_unsup(out_dir, eps: float, steps: int = 3, record: bool = True,
                saturated: int | None = None):
    """UnFlow-style: Adam, a step schedule, two micro-batches accumulated per step, clipping.
    In the last micro-batch, sample ``saturated`` has an over-exposed patch (255 in both
    frames), where the census transform of both frames is exactly 0."""
    model = M.make_unsup()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2], 0.5)
    crit = M.UnFlowLoss(alpha=0.45, eps=eps)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="optical_flow_models:make_unsup") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            opt.zero_grad()
            for k in range(2):
                img1, img2, _, _ = M.kitti_batch(g, n=2)
                if saturated is not None and step == steps - 1 and k == 1:
                    img1[saturated, :, 8:20, 10:22] = 255
                    img2[saturated, :, 8:20, 10:22] = 255
                loss = loss_fn(model(img1, img2), img1, img2) / 2
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
    return model


def fire(fn, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_kitti_ground_truth_storing_missing_flow_as_nan_is_the_target_s_nan_times_the_mask(
        out_dir):
    """A KITTI reader that writes NaN where the validity channel is 0. RAFT's
    ``sequence_loss`` drops those pixels from ``valid`` (NaN < max_flow is False), but then
    weights by multiplication, ``valid * |pred - gt|``, and NaN * 0 is NaN. The recorder
    stops at the loss's target before anything runs; the replay names sample 2, the line of
    the multiplication, and says to fill or select rather than multiply."""
    ev, bundle = fire(train_raft, "make_raft", out_dir, invalid="nan", bad=2)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (2, "input", "loss_args[1]", [2]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == ("loss_args[1]", [2], "input"), rep
    assert o["source"] == line_of("flow_loss += i_weight * (valid[:, None] * i_loss)")
    assert "NaN * 0 is NaN" in rep["hint"] and "torch.where(" in rep["hint"], rep["hint"]


def test_half_precision_correlation_volume_overflows_on_a_16_bit_frame_pair(out_dir):
    """A RAFT port without the encoders' instance norm that builds the correlation volume
    under the loop's float16 autocast (RAFT's own casts ``fmap1.float()``). A frame pair read
    from 16-bit PNGs makes features ~257x larger, and their dot products pass 65504 in the
    matmul. The report names the matmul in CorrBlock (a plain class: the root module), the
    pair's sample, overflow, and both fixes: float32 for the volume, and data out of scale."""
    ev, bundle = fire(train_raft, "make_raft_half_corr", out_dir, fp16=True, sixteen_bit=1)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (2, "forward", "", [1]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["dtype"], o["samples"], rep["cause"]) == \
        ("", "aten.bmm", "+inf", "float16", [1], "overflow"), rep
    assert o["source"] == line_of("corr = torch.matmul(fmap1.transpose(1, 2), fmap2)")
    hint = rep["hint"]
    assert "compute this op in float32" in hint and "out of scale" in hint, hint
    assert "257x" in hint and "drop=1" in hint, hint


def test_a_pyramid_level_one_pixel_wide_divides_by_w_minus_1_in_the_lookup(out_dir):
    """Four correlation levels on an 8x8 feature map: the coarsest is 1x1, and RAFT's
    ``bilinear_sampler`` normalises ``2 * x / (W - 1) - 1``: 0/0 at step 0 for every sample.
    The hint names the size, not the data, and the align_corners=False normalisation."""
    ev, bundle = fire(train_raft, "make_raft_wide_pyramid", out_dir)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.div", "nan", [0, 1, 2, 3], "invalid"), rep
    assert o["source"] == line_of("xgrid = 2 * xgrid / (w - 1) - 1")
    assert "W - 1" in rep["hint"] and "align_corners=False" in rep["hint"], rep["hint"]


def test_generalised_charbonnier_with_eps_0_says_the_eps_is_0_at_the_power_s_backward(out_dir):
    """UnFlow's ``(x^2 + eps^2)^0.45`` with ``eps: 0`` in the config. Over an over-exposed
    patch the census transforms of both frames are exactly 0, the distance is 0, and the
    power's derivative ``0.45 * 0^-0.55`` is infinite: NaN gradients at the last step's
    second micro-batch. The hint said "take (x + eps) ** p" to a loss that adds an eps; it
    says that eps is exactly 0."""
    ev, bundle = fire(train_unsup, out_dir, eps=0.0, saturated=1)
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"], rep["cause"]) == \
        ("<loss>", "PowBackward0", 1, [1], "invalid"), rep
    assert o["source"] == line_of("return (x ** 2 + eps ** 2) ** alpha")
    assert "x ** 0.45 has an infinite derivative at x = 0" in rep["hint"], rep["hint"]
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_sparse_ground_truth_downsampled_over_a_crop_without_lidar_names_its_image(out_dir):
    """PWC-Net's multi-scale EPE on KITTI: the sparse ground truth averaged over each coarse
    cell's valid pixels, ``avg_pool(flow * v) / avg_pool(v)``, then weighted by the cells that
    had one. A crop of image 3 whose top rows lie in the sky (no LiDAR returns) has cells
    with none: 0/0, which the mask's 0 keeps as NaN. The report names the division in the
    downsampling, image 3, and says the masked NaN is to be made safe, not dropped."""
    model = M.make_raft()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=1e-5)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.multiscale_epe, out_dir=out_dir,
                            factory="optical_flow_models:make_raft") as rec:
            for step in range(3):
                img1, img2, flow, valid = M.kitti_batch(g, density=0.6)
                if step == 2:
                    valid[3, :12] = 0
                opt.zero_grad()
                rec.loss_fn(model(img1, img2, iters=3), flow, valid).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("aten.div", "nan", [3], "invalid"), rep
    assert o["source"] == line_of("flow_down = F.avg_pool2d(flow * v, factor) / F.avg_pool2d(")
    hint = rep["hint"]
    assert "0 by 0" in hint and "NaN * 0 is NaN" in hint, hint
    assert line_of("loss = loss + w * (epe * v).sum()").split()[0] in hint, hint
    assert "torch.where(valid, t, 1)" in hint, hint


def test_a_hand_written_epe_at_a_zero_residual_is_sqrt_s_pole_under_the_mask(out_dir):
    """A zero-initialised flow head predicts exactly 0 at step 0, and the sparse ground truth
    holds 0 where it has no return: ``sum((p - gt) ** 2).sqrt()`` is sqrt(0) at those pixels,
    and the mask's 0 gradient times sqrt's infinite derivative is NaN in every image. The
    report names the EPE line's sqrt in the loss and the norm that has a gradient at 0."""
    model = M.make_raft_zero_head()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=1e-5)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.multiscale_epe, out_dir=out_dir,
                            factory="optical_flow_models:make_raft_zero_head") as rec:
            for _ in range(2):
                img1, img2, flow, valid = M.kitti_batch(g, density=0.6)
                opt.zero_grad()
                rec.loss_fn(model(img1, img2, iters=3), flow, valid).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "SqrtBackward0", [0, 1, 2, 3], "invalid"), rep
    assert o["source"] == line_of("epe = torch.sum((p - gt) ** 2, dim=1).sqrt()")
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]


def test_generalised_charbonnier_in_float16_says_its_eps_squared_is_lost(out_dir):
    """The same loss with ``eps = 1e-4`` on a net trained in float16 throughout: ``eps ** 2``
    = 1e-8 is below float16's smallest subnormal, so ``d ** 2 + 1e-8`` is 0 over the
    over-exposed patch. The cause is precision; the hint said "1 - p of a probability rounded
    to 1" and to add an eps; it names the eps float16 rounded to 0 and the fix."""
    model = M.make_unsup_half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    crit = M.UnFlowLoss(alpha=0.45, eps=1e-4)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="optical_flow_models:make_unsup_half") as rec:
            for step in range(3):
                img1, img2, _, _ = M.kitti_batch(g, n=2)
                if step == 2:
                    img1[1, :, 8:20, 10:22] = img2[1, :, 8:20, 10:22] = 255
                img1, img2 = img1.half(), img2.half()
                opt.zero_grad()
                rec.loss_fn(model(img1, img2), img1, img2).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "PowBackward0", [1], "precision"), rep
    assert o["source"] == line_of("return (x ** 2 + eps ** 2) ** alpha")
    hint = rep["hint"]
    assert "the eps 1e-08 added to that input is 0 in float16" in hint, hint
    assert "compute this in float32" in hint and "probability" not in hint, hint


def _train_raft_video(make: str, out_dir, steps: int = 3, record: bool = True,
                      hole: int | None = None):
    """RAFT trained on consecutive pairs of a video, each warm-started from the previous
    pair's flow (``flow_init``, an extra forward argument); sample ``hole``'s warm start in
    the last step has NaN where no flow landed."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=1e-5)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.sequence_loss, out_dir=out_dir,
                         factory=f"optical_flow_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.sequence_loss
        prev = None
        for step in range(steps):
            img1, img2, flow, valid = M.kitti_batch(g)
            kw = {}
            if prev is not None:  # (GMFlow-style models take no warm start)
                init = M.warm_start(prev, hole=hole if step == steps - 1 else None)
                kw = {"flow_init": init}
            opt.zero_grad()
            preds = model(img1, img2, **kw)
            loss_fn(preds, flow, valid).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if make == "make_raft":
                prev = preds[-1].detach()[:, :, ::4, ::4] / 4
    return model


def test_a_warm_start_with_nan_holes_is_named_as_the_flow_init_argument(out_dir):
    """The previous pair's flow splatted forward leaves NaN where nothing landed (griddata's
    linear fill outside the hull); passed as ``flow_init``, the recorder stops at the model's
    input, and the report names that keyword argument and sample 1, not an op."""
    ev, bundle = fire(_train_raft_video, "make_raft", out_dir, hole=1)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (2, "input", 'kwargs["flow_init"]', [1]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], o["op"], rep["cause"]) == \
        ("input", 'kwargs["flow_init"]', [1], None, "input"), rep
    assert "data pipeline" in rep["hint"], rep["hint"]


def test_gmflow_s_windowed_softmax_with_minus_inf_trains_bit_identically(out_dir):
    """GMFlow's matching softmax with displacements beyond the window filled with -inf:
    every row keeps its own position, the -inf never leaves the softmax; no event."""
    recorded = _train_raft_video("make_global_match", out_dir)
    assert not list(out_dir.glob("*.nan"))
    assert _same(recorded, _train_raft_video("make_global_match", out_dir, record=False))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("fp16", [False, True])
def test_raft_on_middlebury_s_1e9_unknown_flow_trains_bit_identically(out_dir, fp16):
    """Missing flow stored as Middlebury's 1e9 (finite: the magnitude filter and the mask's
    0 drop it), in float32 and under float16 autocast with RAFT's float32 volume, whose
    GradScaler skips its first steps on inf gradients: no event, and the same weights."""
    kw = {"fp16": fp16, "invalid": "huge"}
    recorded = train_raft("make_raft", out_dir, **kw)
    assert not list(out_dir.glob("*.nan"))
    assert _same(recorded, train_raft("make_raft", out_dir, record=False, **kw))


def test_unflow_with_eps_on_a_saturated_patch_trains_bit_identically(out_dir):
    recorded = train_unsup(out_dir, eps=0.01, saturated=1)
    assert not list(out_dir.glob("*.nan"))
    assert _same(recorded, train_unsup(out_dir, eps=0.01, saturated=1, record=False))
