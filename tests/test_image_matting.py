"""Image matting trained as matting repos write it (``image_matting_models.py``): an
encoder-decoder over the image and the trimap's one-hot channels, a contextual attention at the
bottleneck, a sigmoid alpha fused with the trimap, a foreground head from the compositing
equation; Charbonnier alpha, composition, Sobel-gradient and Laplacian losses over the trimap's
unknown region; composited crops through a DataLoader, Adam, float16 autocast with a GradScaler,
gradient clipping. With a planted bug the recorder fires at the planted step and ``nanreplay
--json`` names the op, module, samples and cause; the healthy run is not stopped and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import json

import image_matting_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "image_matting_models.py"
NET = "image_matting_models:make_matting_net"


def _alpha_step(rec, model, d):
    return rec.loss_fn(model(d["image"], d["trimap"]), d["alpha"], d["trimap"])


def _full_step(rec, model, d):
    """The matting trainer's full objective, the crops' own foreground and background given
    to the composition term."""
    alpha = model(d["image"], d["trimap"])
    return rec.loss_fn(alpha, d["alpha"], d["trimap"], d["fg"], d["bg"], d["image"])


def _train(out_dir, model, opt, crit, crops, step, factory, *, amp=None, scaler=None):
    """One epoch over the crops (batches of 2) until the recorder raises; returns its error."""
    loader = torch.utils.data.DataLoader(M.MattingCrops(crops), batch_size=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory,
                            scaler=scaler) as rec:
            for d in loader:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                    loss = step(rec, model, d)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
    return info.value


def _origin(rep):
    o = rep["origin"]
    return (o["phase"], o["module"], o["op"], o["made"], o["samples"], rep["cause"])


def test_charbonnier_with_eps_0_is_a_backward_nan_of_the_sqrt_at_the_known_pixels(out_dir):
    """Deep Image Matting's alpha loss ``sqrt(d^2 + eps^2)`` with ``eps = 0``: crop 3 reaches
    past the unknown band into known background, where the trimap-fused alpha is exactly the
    ground truth; the forward is finite (those pixels are weighted 0) but the sqrt's
    derivative at 0 is infinite and times the 0 weight it is NaN, in backward only."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 3, value=0.0))
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3),
                 M.CharbonnierAlphaLoss(eps=0.0), crops, _alpha_step, NET)
    assert (err.event["step"], err.event["phase"]) == (1, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("backward", "<loss>", "SqrtBackward0", "nan", [1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "torch.sqrt((alpha - gt) ** 2")
    assert "the eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_charbonnier_eps_lost_in_pure_float16_training_drops_the_stable_formula_advice(out_dir):
    """The same loss with its ``eps = 1e-6`` kept, trained in float16 throughout
    (``model.half()``, half crops, SGD with momentum): ``eps ** 2 = 1e-12`` is 0 in float16,
    so at crop 3's known pixels ``sqrt(0 + 1e-12)`` is ``sqrt(0)`` again, and its backward is
    NaN. The hint said the eps is lost, but led with "use a numerically stable formula
    (torch.var ...; logsigmoid ...)" and "put an eps under the root (torch.sqrt(x + 1e-8))",
    an eps float16 loses too, to a loss that has one under the root: it says the eps is lost
    only."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 3, value=0.0))
    crops = {k: v.half() for k, v in crops.items()}
    model = M.make_half_matting_net()
    err = _train(out_dir, model, torch.optim.SGD(model.parameters(), 1e-2, momentum=0.9),
                 M.CharbonnierAlphaLoss(eps=1e-6), crops, _alpha_step,
                 "image_matting_models:make_half_matting_net")
    assert (err.event["step"], err.event["phase"]) == (1, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("backward", "<loss>", "SqrtBackward0", "nan", [1], "precision"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "torch.sqrt((alpha - gt) ** 2")
    assert "the eps 1e-12 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert "stable formula" not in rep["hint"], rep["hint"]
    assert "torch.sqrt(x + 1e-8)" not in rep["hint"], rep["hint"]


def test_a_sobel_magnitude_without_eps_is_a_backward_nan_on_the_flat_known_band(out_dir):
    """The gradient loss on Sobel magnitudes ``sqrt(gx^2 + gy^2)``, written without an eps:
    crop 3's known background band is flat in the fused alpha, its magnitude exactly 0, and
    sqrt's derivative there infinite: a backward NaN on that crop only."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 3, value=0.0))
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.GradMagLoss(),
                 crops, _alpha_step, NET)
    assert (err.event["step"], err.event["phase"]) == (1, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("backward", "<loss>", "SqrtBackward0", "nan", [1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "mp, mg = torch.sqrt(")
    assert "torch.linalg.vector_norm" in rep["hint"], rep["hint"]


def test_a_crop_with_an_empty_unknown_region_is_a_0_by_0_of_its_unknown_count(out_dir):
    """GCA's regression loss divided per crop by that crop's unknown count: crop 5 is all
    foreground (a random crop inside the subject), its count is 0 and its L1 sum 0, 0/0. The
    report names the division on that crop and that it has no valid entry."""
    crops = M.composited_crops()
    crops["alpha"][5], crops["trimap"][5] = 1.0, 1.0
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.PerCropL1Loss(),
                 M.composite(crops), _alpha_step, NET)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("loss", "<loss>", "aten.div", "nan", [1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "return (l1 / w.sum(dim=(1, 2, 3)))")
    assert "no valid entry" in rep["hint"] and "count.clamp(min=1)" in rep["hint"], rep["hint"]


def test_a_trimap_decoded_as_128_over_255_selects_no_unknown_pixel_in_any_crop(out_dir):
    """The trimaps read from 8-bit PNGs and divided by 255: the unknown value is 128 / 255,
    never the 0.5 the loss compares with, so every crop's unknown count is 0 and the per-crop
    loss 0/0 in every sample at the first step. The hint said to add an eps to the denominator
    or skip those rows (an eps would train on nothing in silence); it says the comparison's
    mask selects nothing in any sample, a value the data does not hold."""
    crops = M.composite(M.composited_crops())
    crops["trimap"] = torch.full_like(crops["trimap"], 128 / 255)
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.PerCropL1Loss(),
                 crops, _alpha_step, NET)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("loss", "<loss>", "aten.div", "nan", [0, 1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "return (l1 / w.sum(dim=(1, 2, 3)))")
    assert "0 in every sample of the batch: the mask selects nothing" in rep["hint"], rep["hint"]
    assert "128 / 255" in rep["hint"], rep["hint"]


def test_foreground_divided_by_an_alpha_of_0_is_a_0_by_0_in_the_foreground_head(out_dir):
    """FBA-style ``F = (I - (1 - alpha) B) / alpha`` without a clamp: crop 2's known
    background has the fused alpha exactly 0 and ``I = B`` there, 0/0 in the head's forward."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 2, value=0.0))
    model = M.make_matting_fg_net()

    def step(rec, model, d):
        alpha, fg = model(d["image"], d["trimap"], d["bg"])
        return rec.loss_fn(alpha, d["alpha"], d["trimap"], fg, d["bg"], d["image"])

    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.MattingLoss(),
                 crops, step, "image_matting_models:make_matting_fg_net")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (1, "forward", "fg_head"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("forward", "fg_head", "aten.div", "nan", [0], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "return (image - (1 - alpha) * bg)")
    assert "0 by 0" in rep["hint"], rep["hint"]


def test_an_unscaled_16_bit_crop_overflows_the_attention_logits_under_float16(out_dir):
    """Deep Image Matting's VGG-style net (no BatchNorm) under float16 autocast with a
    GradScaler: crop 6 was decoded from a 16-bit PNG and never rescaled (values to 65535); its
    features grow through the convs and ``q k^T`` at the bottleneck's attention passes
    float16's 65504. The report names that bmm on that crop as an overflow, and the data out
    of scale."""
    crops = M.composite(M.composited_crops())
    crops["image"][6] *= 65535
    model = M.make_dim_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3),
                 M.CharbonnierAlphaLoss(), crops, _alpha_step,
                 "image_matting_models:make_dim_net", amp=torch.float16,
                 scaler=torch.amp.GradScaler("cpu"))
    assert (err.event["step"], err.event["phase"], err.event["module"]) == \
        (3, "forward", "attn"), err.event
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("forward", "attn", "aten.bmm", "+inf", [0], "overflow"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "torch.softmax(torch.bmm(q, k)")
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "out of scale" in rep["hint"], rep["hint"]


def test_adam_with_eps_0_on_the_unused_foreground_channel_is_an_optimizer_event(out_dir):
    """Adam with ``eps=0``: every crop's trimap is all unknown, so the first conv's weights on
    the trimap's background and foreground one-hot channels (all 0) get gradients of exactly
    0; ``m / (sqrt(v) + 0)`` is 0/0 there at the first update."""
    crops = M.composite(M.composited_crops())
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3, eps=0.0),
                 M.CharbonnierAlphaLoss(), crops, _alpha_step, NET)
    assert (err.event["step"], err.event["phase"]) == (0, "optimizer"), err.event
    rep = nanreplay_json(err.bundle_path, code=1)  # (not re-run: the weights after the update)
    assert rep["cause"] == "optimizer", json.dumps(rep, indent=1)
    assert "made enc1.0.weight non-finite" in rep["hint"], rep["hint"]
    assert "with eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]


def test_a_foreground_left_nan_where_alpha_is_0_is_input_kept_by_the_composite(out_dir):
    """The training foregrounds were estimated offline as ``(I - (1 - alpha) B) / alpha``,
    NaN in crop 4's known background (alpha 0). The composition loss re-composites
    ``fg * alpha + bg * (1 - alpha)``: the NaN times alpha's 0 is NaN. An input event on the
    loss's ``fg``; the hint said the product multiplied it "by a mask's 0" and to weight by
    the mask, where the 0 is the predicted alpha's (no mask in that line): it says the factor
    is a weight that is 0 there, and to make the data finite where it is made."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 4, value=0.0))
    with torch.no_grad():
        crops["fg"] = (crops["image"] - (1 - crops["alpha"]) * crops["bg"]) / crops["alpha"]
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.MattingLoss(),
                 crops, _full_step, NET)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "input", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[3]", [0], "input"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "comp = fg * alpha + bg * (1 - alpha)")
    assert "NaN * 0 is NaN" in rep["hint"] and "mask's 0" not in rep["hint"], rep["hint"]
    assert "no 0/1 mask but a weight that is 0 there" in rep["hint"], rep["hint"]


def test_a_bce_written_out_on_the_fused_alpha_names_the_target_s_0_and_the_torch_loss(out_dir):
    """An alpha BCE written out, ``-(gt log a + (1 - gt) log(1 - a))``, with the known pixels
    weighted 0.1: crop 5 reaches known foreground, where the fused alpha is exactly 1, so
    ``log(1 - a)`` is -inf and ``(1 - gt)`` is 0 there: 0 * -inf. The hint called it an
    entropy's ``p * log(p)`` and advised ``xlogy(p, p.clamp_min(tiny))``; the 0 is the
    target's and the -inf the prediction's log, and it names the BCE torch writes for it."""
    crops = M.composite(M.with_known_band(M.composited_crops(), 5, value=1.0))
    model = M.make_matting_net()
    err = _train(out_dir, model, torch.optim.Adam(model.parameters(), 1e-3), M.AlphaBCELoss(),
                 crops, _alpha_step, NET)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "loss", "<loss>")
    rep = nanreplay_json(err.bundle_path)
    assert _origin(rep) == ("loss", "<loss>", "aten.log", "-inf", [1], "invalid"), \
        json.dumps(rep, indent=1)
    assert rep["origin"]["source"] == source_line(MODELS, "bce = -(gt * torch.log(alpha)")
    assert "by a target's 0 at the same entries" in rep["hint"], rep["hint"]
    assert "F.binary_cross_entropy_with_logits" in rep["hint"], rep["hint"]
    assert "p * log(p)" not in rep["hint"], rep["hint"]


def test_a_micro_batch_with_no_unknown_pixel_is_a_0_by_0_of_the_batch_count(out_dir):
    """GCA's regression loss divides by the batch's unknown count; with gradient accumulation
    over two micro-batches of 2, the first micro-batch of step 1 holds two crops inside the
    subject and the background (all known): 0/0 over one 0-d count, no row to blame."""
    crops = M.composited_crops()
    for i in (4, 5):
        crops["alpha"][i], crops["trimap"][i] = float(i == 4), float(i == 4)
    crops = M.composite(crops)
    model = M.make_matting_net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loader = torch.utils.data.DataLoader(M.MattingCrops(crops), batch_size=2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.RegressionL1Loss(), out_dir=out_dir,
                            factory=NET) as rec:
            for i, d in enumerate(loader):
                (_alpha_step(rec, model, d) / 2).backward()
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (1, "loss", "<loss>", [])
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["micro_batch"], rep["cause"]) == \
        ("aten.div", "nan", 0, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == source_line(MODELS, "return ((alpha - gt).abs() * w).sum() / w.sum()")
    assert "no row is to blame" in rep["hint"], rep["hint"]


def _healthy_run(recorded: bool, out_dir):
    """Crops reaching known background and foreground, the full objective with its eps's,
    bfloat16 autocast, gradient clipping, two epochs; returns the model."""
    crops = M.with_known_band(M.with_known_band(M.composited_crops(), 3, value=0.0), 5,
                              value=1.0)
    crops["alpha"][6], crops["trimap"][6] = 0.0, 0.0  # (a crop of background only)
    crops = M.composite(crops)
    model, crit = M.make_matting_net(), M.MattingLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    loader = torch.utils.data.DataLoader(M.MattingCrops(crops), batch_size=2)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=NET) \
        if recorded else None
    if rec is not None:
        rec.__enter__()
    for _ in range(2):
        for d in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                alpha = model(d["image"], d["trimap"])
            loss = (rec.loss_fn if rec else crit)(alpha.float(), d["alpha"], d["trimap"],
                                                  d["fg"], d["bg"], d["image"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    if rec is not None:
        rec.__exit__(None, None, None)
        assert rec.event is None and rec.step == 8, rec.event
    return model


def test_healthy_matting_run_is_not_stopped_and_trains_bit_identically(out_dir):
    recorded = _healthy_run(True, out_dir)
    bare = _healthy_run(False, out_dir)
    for (name, a), b in zip(recorded.state_dict().items(), bare.state_dict().values()):
        assert torch.equal(a, b), name
    assert not out_dir.exists() or not list(out_dir.glob("*.nan"))
