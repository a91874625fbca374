"""End to end: computer vision trained with kornia 0.9.0 (``kornia_vision_models``: a
homography regressor with a photometric loss through ``get_perspective_transform`` and
``warp_perspective``, a residual denoiser with ``ssim_loss`` / ``psnr_loss`` and an edge loss
of ``spatial_gradient`` magnitudes, a segmenter with a ``K.AugmentationSequential`` inside the
model and ``focal_loss`` + ``dice_loss``), trained under the recorder until a planted bug
fires, then replayed with the CLI."""

from __future__ import annotations

import kornia_vision_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

BS = 4
KORNIA = "site-packages/kornia/"

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("kornia_vision_models.py", text)


def homography(out_dir, data, steps: int = 4):
    """Adam, gradient clipping; the loss warps the first view by the predicted corners."""
    model = M.make_homography()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.PhotometricLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="kornia_vision_models:make_homography") as rec:
        for step, (a, b, corners) in enumerate(DataLoader(data, batch_size=BS)):
            if step == steps:
                break
            loss = rec.loss_fn(model(a, b), a, b, corners)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


def denoise(out_dir, data, crit, factory: str = "make_denoiser", steps: int = 4,
            amp: bool = False, lr: float | None = None):
    """Adam (or SGD with momentum at ``lr``), float16 autocast with ``amp``."""
    model = getattr(M, factory)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if lr is None else \
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"kornia_vision_models:{factory}") as rec:
        for step, (noisy, clean) in enumerate(DataLoader(data, batch_size=BS)):
            if step == steps:
                break
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                loss = rec.loss_fn(model(noisy), clean)
            opt.zero_grad()
            loss.backward()
            opt.step()


def segment(out_dir, data, steps: int = 4, record: bool = True) -> M.Segmenter:
    """SGD with momentum; the augmentation runs inside the model on image and mask, the
    loop computes the batch's class weights and passes them to the loss."""
    model = M.make_segmenter()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    crit = M.SegLoss()

    def loop(loss_fn):
        for step, (x, mask) in enumerate(DataLoader(data, batch_size=BS)):
            if step == steps:
                break
            logits, mask = model(x, mask)
            loss = loss_fn(logits, mask, M.class_weights(mask))
            opt.zero_grad()
            loss.backward()
            opt.step()

    if not record:
        loop(crit)
        return model
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="kornia_vision_models:make_segmenter") as rec:
        loop(rec.loss_fn)
    return model


def segment_in_loop(out_dir, data, steps: int = 4):
    """The augmentation and standardisation in the loop, on batches from two workers."""
    model = M.make_plain_segmenter()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    aug, crit = M.loop_augmentation(data), M.SegLoss()
    batches = iter(DataLoader(data, batch_size=BS, num_workers=2))
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="kornia_vision_models:make_plain_segmenter") as rec:
            for _ in range(steps):
                x, mask = next(batches)
                x, m = aug(x, mask[:, None].float())
                logits, mask = model(x, m[:, 0].round().long())
                loss = rec.loss_fn(logits, mask, M.class_weights(mask))
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        del batches  # (the event's traceback would keep the workers until a later gc)


def match_weights(out_dir, data, steps: int = 4):
    """Adam; the loss solves kornia's weighted DLT from the matches' learned weights."""
    model = M.make_weighter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.CornerLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="kornia_vision_models:make_weighter") as rec:
        for step, (desc, p1, p2, h) in enumerate(DataLoader(data, batch_size=BS)):
            if step == steps:
                break
            loss = rec.loss_fn(model(desc), p1, p2, h)
            opt.zero_grad()
            loss.backward()
            opt.step()


def event(fn, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kwargs)
    return info.value.event, nanreplay_json(info.value.bundle_path)


def test_healthy_kornia_training_raises_no_event_and_draws_the_same_augmentations(tmp_path):
    """The three models train without an event; the segmenter, whose augmentation draws its
    affine, jitter and perspective from torch's generator inside the model, ends with the
    same weights bit for bit with and without the recorder."""
    homography(tmp_path, M.WarpPairs(16))
    denoise(tmp_path, M.NoisyImages(16), M.RestorationLoss())
    denoise(tmp_path, M.NoisyImages(16, blank=[5]), M.EdgeAwareLoss(eps=1e-8),
            "make_clamped_denoiser")
    recorded = segment(tmp_path, M.Shapes(16))
    assert not list(tmp_path.rglob("*.nan"))
    plain = segment(tmp_path, M.Shapes(16), record=False)
    for (name, p), q in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name


def test_corners_on_one_line_name_kornia_s_division_and_the_record(tmp_path):
    """A sample's four corners annotated on one line: get_perspective_transform's closed
    form divides by their 0 determinant (0/0). The loss is finite until the homography; the
    op is kornia's, called from the loss's line, on that sample alone."""
    ev, rep = event(homography, tmp_path, M.WarpPairs(32, collinear=[6]))
    assert (ev["step"], ev["phase"]) == (1, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.div", [6 - BS]), rep
    assert KORNIA + "geometry/transform/imgwarp.py" in o["source"], o["source"]
    assert o["called_from"] == line_of("h = get_perspective_transform(corners, corners + ")
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert "four corners on one line" in rep["hint"], rep["hint"]


def test_psnr_of_an_identity_denoiser_on_clean_pairs_names_the_perfect_fit(tmp_path):
    """The curriculum's first batch holds pairs with no noise and the residual branch starts
    at 0: the output is the target, mse 0, and psnr_loss's max² / mse is inf. The hint said
    only to add an eps to the denominator; it now names the output equal to the target."""
    ev, rep = event(denoise, tmp_path, M.NoisyImages(32, sigmas=[0.0] * 4 + [0.1] * 28),
                    M.RestorationLoss())
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "-inf")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.reciprocal", []), rep
    assert KORNIA + "metrics/psnr.py" in o["source"], o["source"]
    assert o["called_from"] == line_of("+ 0.01 * kornia.losses.psnr_loss(")
    assert "the model's output equals loss_args[1] exactly" in rep["hint"], rep["hint"]
    assert "report PSNR as a metric" in rep["hint"], rep["hint"]


def test_healthy_psnr_names_no_perfect_fit(tmp_path):
    """The same loss on noisy pairs, an eps in the edge term: no event (the hint's check
    reads only a pole of the loss)."""
    denoise(tmp_path, M.NoisyImages(16, sigmas=[0.1] * 16), M.RestorationLoss())
    assert not list(tmp_path.rglob("*.nan"))


def test_sqrt_of_a_flat_gradient_magnitude_is_a_backward_nan_on_the_blank_frame(tmp_path):
    """The edge loss's sqrt(gx² + gy² + 0) is 0 on a blank frame the clamp makes flat: finite
    forward, the sqrt's derivative at 0 is inf, and the backward makes NaN there alone. The
    gradient entering the sqrt there is 0, which |mag(pred) - mag(target)|'s sign(0) sent:
    the hint said the code masked those zeros itself (a count of none, not a blank record)."""
    ev, rep = event(denoise, tmp_path, M.NoisyImages(32, blank=[5]), M.EdgeAwareLoss(),
                    "make_clamped_denoiser")
    assert (ev["step"], ev["phase"], ev["samples"]) == (1, "backward", [5 - BS])
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "SqrtBackward0", [5 - BS]), rep
    assert o["source"] == line_of("return torch.sqrt(g[:, :, 0] ** 2")
    assert (o["masked"], o["masked_by"]) == (True, "abs"), o
    hint = rep["hint"]
    assert "sqrt(x + eps)" in hint and "the eps added to that input is exactly 0" in hint, hint
    # abs's sign(0) sent the 0 gradient: no mask of the code's, the frame no count of none
    assert "because abs's derivative is 0 at the value it took there" in hint, hint
    assert "the code masks these zeros out itself" not in hint, hint


def test_the_edge_loss_under_float16_autocast_on_0_255_frames_overflows(tmp_path):
    """Frames left in 0..255, float16 autocast: spatial_gradient's convolution runs in
    float16 and the squared gradients pass 65504."""
    ev, rep = event(denoise, tmp_path, M.NoisyImages(32, scale=255.0), M.EdgeAwareLoss(),
                    amp=True)
    assert (ev["step"], ev["phase"]) == (0, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["dtype"], o["samples"]) \
        == (True, "overflow", "<loss>", "aten.pow", "float16", list(range(BS))), rep
    assert o["source"] == line_of("return torch.sqrt(g[:, :, 0] ** 2")
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]


def test_a_learning_rate_blowup_is_an_overflow_of_a_diverging_run(tmp_path):
    """SGD at lr 5: the loss grows a thousandfold a step until a convolution's output passes
    float32's range; the hint names the divergence and the learning rate."""
    ev, rep = event(denoise, tmp_path, M.NoisyImages(64), torch.nn.MSELoss(), steps=16,
                    lr=5.0)
    assert (ev["step"], ev["phase"], ev["module"]) == (5, "forward", "body.2")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "overflow", "body.2", "aten.convolution", list(range(BS))), rep
    assert "the run was diverging" in rep["hint"] and "lower the learning rate" in rep["hint"]


def test_inverse_class_frequencies_of_a_class_absent_from_the_batch_name_the_class(tmp_path):
    """A batch with no square: its count is 0, total / count inf, and normalising the weights
    by their sum gives NaN for that class and 0 for the others. The hint read the NaN as the
    data's (a foreground divided by an alpha), named 'rows []' and prioritized replay's
    importance weights; it now says the weight holds no sample's rows and names the class."""
    ev, rep = event(segment, tmp_path, M.Shapes(32, no_square=[4, 5, 6, 7]))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        1, "input", "loss_args[2]", [])
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"]) == (
        True, "input", "loss_args[2]", []), rep
    assert KORNIA + "losses/focal.py" in o["source"], o["source"]
    hint = rep["hint"]
    assert "which holds no sample's rows" in hint and "rows []" not in hint, hint
    assert "one per class (not one per sample of the 4), NaN at class(es) [2]" in hint, hint
    assert "inverse class frequency" in hint and "priority" not in hint, hint


def test_standardising_by_a_channel_of_zero_std_is_the_pipeline_s_not_a_record_s(tmp_path):
    """A band filled with one value in every image: the training set's std of that channel
    is 0, and K.Normalize in the loop divides by it. An input event on every sample, the
    whole channel, named as a per-feature step of the pipeline; the healthy data trains."""
    segment_in_loop(tmp_path / "healthy", M.Shapes(16))
    assert not list(tmp_path.rglob("*.nan"))
    ev, rep = event(segment_in_loop, tmp_path, M.Shapes(32, flat_channel=2))
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        0, "input", "args[0]", list(range(BS)))
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["arg"], o["samples"]) == (
        True, "input", "args[0]", "x", list(range(BS))), rep
    assert "all at index 2 of dim 1" in rep["hint"], rep["hint"]
    assert "a standardisation dividing by a constant column's zero std" in rep["hint"]


def test_a_weighted_dlt_of_matches_at_one_point_names_the_singular_solve(tmp_path):
    """A textureless image's matches all at one point: kornia's find_homography_dlt tests
    each system with a detached lu_solve (NaN for the singular one) and returns NaN for that
    sample on purpose. The op named is that solve, on that sample; the hint said 'at a pole or
    outside its domain: clamp the op's input', which a solve has none of."""
    match_weights(tmp_path / "healthy", M.Matches(16))
    assert not list(tmp_path.rglob("*.nan"))
    ev, rep = event(match_weights, tmp_path, M.Matches(32, repeated=[5]))
    assert (ev["step"], ev["phase"]) == (1, "loss")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "<loss>", "aten.linalg_lu_solve", [5 - BS]), rep
    assert o["called_from"] == line_of("h = find_homography_dlt(p1, p2, weights)")
    hint = rep["hint"]
    assert "of a singular system (a zero pivot in its factor" in hint, hint
    assert "repeated or collinear points" in hint and "clamp the op's input" not in hint, hint
