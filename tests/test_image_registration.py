"""End to end on deformable image registration (``image_registration_models``): VoxelMorph's
U-Net and spatial transformer, a diffeomorphic variant (scaling and squaring), local NCC,
diffusion regularisation, a Jacobian-determinant term and the Dice of warped atlas labels,
trained from a DataLoader of min-max normalised pairs with Adam, clipping, a scheduler, and
(some) gradient accumulation under bfloat16 autocast or float16 AMP with a GradScaler. Each
planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import image_registration_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

# A GradScaler's skipped first steps leave the schedule's step before the optimizer's, which
# torch warns of (as in any float16 AMP loop with a scheduler).
SKIPPED_STEP = "ignore:Detected call of `lr_scheduler:UserWarning"


def line_of(text: str) -> str:
    return source_line("image_registration_models.py", text)


def train(make: str, crit, data, out_dir, record: bool = True, lr: float = 1e-4,
          accum: int = 1, amp: torch.dtype | None = None):
    """VoxelMorph's loop: pairs in batches of 4 (``accum`` micro-batches of 4 // accum,
    shuffled by a seeded generator when accumulating), the semi-supervised model warping the
    moving labels too, Adam with a step schedule and clipping; ``amp`` float16 runs model and
    loss under autocast with a GradScaler, bfloat16 the model only. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=amp == torch.float16)
    loader = DataLoader(data, batch_size=4 // accum, shuffle=accum > 1,
                        generator=torch.Generator().manual_seed(3))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler,
                         factory=f"image_registration_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for i, (mv, fv, ms, fs) in enumerate(loader):
            with torch.autocast("cpu", amp or torch.bfloat16, enabled=amp is not None):
                moved, moved_seg, disp = model(mv, fv, moving_seg=ms)
                if amp == torch.bfloat16:  # (the loss in float32, outside the model's autocast)
                    moved, moved_seg, disp = moved.float(), moved_seg.float(), disp.float()
                loss = loss_fn(moved, moved_seg, disp, fv, fs) / accum
            scaler.scale(loss).backward()
            if (i + 1) % accum == 0:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                sched.step()
    return model


def fire(make: str, crit, data, tmp_path, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, data, tmp_path, **kw)
    return info.value.event, info.value.bundle_path


def test_ncc_without_eps_in_a_skull_stripped_background_names_the_division_and_the_pair(
        tmp_path):
    """Pair 13's scans are skull-stripped: exact zeros outside the brain, so NCC's windows
    there have I_var = J_var = cross = 0 and ``cross / sqrt(I_var * J_var)`` is 0/0 (the
    common NaN of an NCC ported without VoxelMorph's eps). A loss event at step 3 on row 1;
    the replay names the division on its line, 0/0, the eps advice, and dropping the pair
    makes the step finite."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(eps=None),
                      M.PairDataset(16, stripped=(13,)), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (3, "loss", "<loss>", "nan"), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", [1]), o
    assert o["source"] == line_of("cc = cross / torch.sqrt(i_var * j_var)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"] and "eps" in rep["hint"], rep
    assert rep["what_if"][0]["try"] == "drop=1" and rep["what_if"][0]["finite"], rep["what_if"]


def test_unrecorded_ncc_without_eps_ruins_the_weights(tmp_path):
    """Without the recorder the same run's weights are NaN after the step: the event above
    is the bug, not a false alarm."""
    model = train("make_vxm", M.RegistrationLoss(eps=None), M.PairDataset(16, stripped=(13,)),
                  tmp_path, record=False)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_blank_scan_min_max_normalised_in_the_dataset_is_an_input_event(tmp_path):
    """Scan 14 was exported all zero; the Dataset's ``(x - min) / (max - min)`` makes it NaN
    before the model: an input event naming args[0] and row 2 of step 3, cause ``input``
    with the normalisation in the hint; dropping it makes the step finite."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(), M.PairDataset(16, blank=(14,)),
                      tmp_path)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[0]",
                                                                     [2]), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (rep["cause"], o["tensor"], o["samples"]) == ("input", "args[0]", [2]), rep
    assert "normalisation" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["try"] == "drop=2" and rep["what_if"][0]["finite"], rep["what_if"]


def test_a_blank_fixed_scan_scaled_by_its_max_in_forward_names_the_division(tmp_path):
    """A port that scales each scan by its maximum inside ``forward``: fixed scan 6 is all
    zero, ``fixed / fixed.amax()`` is 0/0, the U-Net's flow is NaN on that pair and
    grid_sample reads its NaN coordinates as outside the volume (the warped image stays
    finite there). The replay names the root's division on the fixed scan's line, row 2 of
    step 1, 0/0, and the bisection agrees."""
    ev, bundle = fire("make_vxm_raw", M.RegistrationLoss(),
                      M.PairDataset(16, blank_fixed=(6,), raw=True), tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (1, "forward", "", [2]), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.div", "nan", [2]), o
    assert o["source"] == line_of("fixed = fixed / fixed.amax(dim=(1, 2, 3, 4)"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert rep["bisection"]["agrees"] is True, rep["bisection"]
    assert rep["what_if"][0]["try"] == "drop=2" and rep["what_if"][0]["finite"], rep["what_if"]


def test_dice_of_a_structure_absent_from_both_label_maps_names_the_zero_smooth(tmp_path):
    """Pair 9's label maps lack the inner structure in both scans, and the Dice was
    configured with ``smooth=0``: 0/0 in that pair's row. The replay names the division,
    row 1 of step 2, and says the eps given was exactly 0. The hint now also names the
    structure absent from the pair: channel 2 of the moving labels (the model's keyword
    input) and of the fixed labels (loss argument 4), empty in row 1 alone."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(dice_smooth=0),
                      M.PairDataset(16, no_inner=(9,)), tmp_path)
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [1], "invalid"), rep
    assert o["source"] == line_of("return 1 - ((2 * inter + smooth) / (total + smooth))"), o
    assert "exactly 0" in rep["hint"], rep["hint"]
    assert ('Sample(s) 1 hold no entry of kwargs["moving_seg"] channel 2 and loss_args[4] '
            "channel 2") in rep["hint"], rep["hint"]


def test_logdet_of_a_folding_fields_jacobians_says_the_map_folds(tmp_path):
    """The same prior by ``torch.logdet`` of the per-voxel Jacobian matrices: the replay
    names logdet, every row, and said to take ``slogdet(W).logabsdet`` (Glow's advice, for a
    matrix whose sign is arbitrary), which would count the folds as volume change; for a
    field of 3x3 matrices it now says the map folds and to penalise the folds instead."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(jac="logdet", lam=0.0),
                      M.PairDataset(16), tmp_path, lr=3e-2)
    assert (ev["step"], ev["phase"]) == (1, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["all_samples"], rep["cause"]) == (
        "aten.logdet", "nan", True, "invalid"), rep
    assert o["source"] == line_of("return loss + self.gamma * torch.logdet("), o
    assert "the map folds there" in rep["hint"] and "relu(-det)" in rep["hint"], rep["hint"]
    assert "do not take logabsdet" in rep["hint"], rep["hint"]


def test_log_jacobian_term_of_a_folding_field_names_the_log(tmp_path):
    """Adam at 3e-2 (not VoxelMorph's 1e-4) without the diffusion term: after one update
    the field folds in every pair, det(I + grad u) < 0, and the log-Jacobian prior's
    ``log(det)`` is NaN at step 1. The replay names the log on its line, every row, a
    negative input, and says to fix what drives it out of the domain."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(jac="log", lam=0.0),
                      M.PairDataset(16), tmp_path, lr=3e-2)
    assert (ev["step"], ev["phase"]) == (1, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["made"], o["all_samples"], rep["cause"]) == (
        "aten.log", "nan", True, "invalid"), rep
    assert o["source"] == line_of("return loss + self.gamma * torch.log(det)"), o
    assert "negative" in rep["hint"] and "fix what drives it out" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("split", [False, True])
def test_brain_masked_ncc_backward_through_the_background_names_the_node(tmp_path, split):
    """NCC averaged over windows centred in the brain by ``torch.where(mask, cc, 0)``, no
    eps: the background's 0/0 is dropped in the forward and the loss is finite, but the
    division's backward still sends 0 * inf there; with the eps outside the roots,
    ``cross / (sqrt(I_var) sqrt(J_var) + eps)`` is finite and SqrtBackward0 at 0 is not.
    A backward event; the replay names the node, the NCC line, row 1 and the where advice."""
    crit = (M.RegistrationLoss(split=True) if split
            else M.RegistrationLoss(eps=None, masked=True))
    ev, bundle = fire("make_vxm", crit, M.PairDataset(16, stripped=(13,)), tmp_path)
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    node = "SqrtBackward0" if split else "DivBackward0"
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "<loss>", node, [1], "invalid"), rep
    text = ("cc = cross / (torch.sqrt(i_var) * torch.sqrt(j_var)" if split
            else "cc = cross / torch.sqrt(i_var * j_var)")
    assert o["source"] == line_of(text), o
    assert "torch.where" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["try"] == "drop=1" and rep["what_if"][0]["finite"], rep["what_if"]


@pytest.mark.filterwarnings(SKIPPED_STEP)
def test_float16_amp_over_unnormalised_intensities_names_the_box_filter(tmp_path):
    """Scans left in scanner units (up to ~735) under float16 autocast with a GradScaler,
    the loss inside the autocast block: NCC's box filter sums 125 voxels in float16 and
    overflows past 65504 in every pair at step 0. The replay names the convolution on the
    box filter's line, overflow, and float32 as the fix that works."""
    ev, bundle = fire("make_vxm", M.RegistrationLoss(), M.PairDataset(16, raw=True), tmp_path,
                      amp=torch.float16)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["made"], o["dtype"], o["all_samples"], rep["cause"]) == (
        "aten.convolution", "+inf", "float16", True, "overflow"), rep
    assert o["source"] == line_of("return F.conv3d(x, filt, padding=pad)"), o
    assert "float32" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("dtype=float32", True)], rep


def test_accumulated_bfloat16_micro_batch_names_its_pair(tmp_path):
    """Two micro-batches of 2 per step, shuffled, the diffeomorphic model (seven squarings)
    under bfloat16 autocast: stripped pair 1 lands second in step 0's second micro-batch.
    Event and replay name micro-batch 1, its row 1, and NCC's division."""
    ev, bundle = fire("make_vxm_diff", M.RegistrationLoss(eps=None),
                      M.PairDataset(16, stripped=(1,)), tmp_path, accum=2, amp=torch.bfloat16)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (0, "loss", 1), ev
    rep = nanreplay_json(bundle, "--try", "auto")
    o = rep["origin"]
    assert (o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "aten.div", 1, [1], "invalid"), rep
    assert rep["what_if"][0]["try"] == "drop=1" and rep["what_if"][0]["finite"], rep["what_if"]


@pytest.mark.filterwarnings(SKIPPED_STEP)
@pytest.mark.parametrize("make,kw", [
    ("make_vxm_diff", {"accum": 2, "amp": torch.bfloat16}),
    ("make_vxm", {"amp": torch.float16}),
    ("make_vxm", {})])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, make, kw):
    """NCC with its eps over the skull-stripped pair (constant windows, 0 / sqrt(eps)), the
    folding penalty relu(-det), Dice with its smooth: no event, and bit-identical weights
    with and without the recorder, under accumulation and bfloat16, float16 AMP with a
    GradScaler, and float32."""
    data = M.PairDataset(16, stripped=(1, 13))
    recorded = train(make, M.RegistrationLoss(), data, tmp_path, **kw)
    plain = train(make, M.RegistrationLoss(), data, tmp_path, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_voxelmorphs_list_of_losses_names_the_output_whose_gradient_went_bad(tmp_path):
    """VoxelMorph's train script sums ``losses[n](y_true[n], y_pred[n]) * weights[n]`` over a
    list, and only the image loss (NCC) is the recorder's ``loss_fn``; the Dice term (smooth
    0) of pair 9, whose label maps lack the inner structure, is 0/0 outside it. The loss the
    recorder watches stays finite, so the step ends at the backward of step 2; the replay
    names the gradient entering model output 1 (the warped labels) on row 1, and says the
    loss it was given re-ran finite and to compute the whole loss inside loss_fn."""
    model = M.make_vxm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    data = M.PairDataset(16, no_inner=(9,))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.NCC(), out_dir=tmp_path,
                            factory="image_registration_models:make_vxm") as rec:
            losses = [rec.loss_fn, lambda t, p: M.dice_loss(p, t, smooth=0.0),
                      lambda t, p: M.diffusion(p)]
            weights = [1, 1, 0.02]
            for mv, fv, ms, fs in DataLoader(data, batch_size=4):
                y_pred = model(mv, fv, moving_seg=ms)
                y_true = [fv, fs, None]
                loss = 0
                for n, loss_function in enumerate(losses):
                    loss = loss + loss_function(y_true[n], y_pred[n]) * weights[n]
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == (
        "grad of the model output 1", [1], None), rep
    assert "compute the whole loss inside loss_fn" in rep["hint"], rep["hint"]


def test_affine_head_zero_initialised_without_the_identity_names_its_parameters(tmp_path):
    """Affine pre-alignment: a CNN regresses each pair's 3x4 matrix, inverted for an
    inverse-consistent term on the fixed scan. Its head was zero-initialised, bias too (the
    identity forgotten), so every matrix is 0 and ``torch.linalg.inv`` raises at step 0. The
    replay names the inversion, every row, and said the samples 'had nothing to sum over (a
    user with no ratings)'; a matrix of zeros in every sample is the model's, and the hint
    now names the head's parameters all 0 and starting it at the identity."""
    model = M.make_affine_vxm(identity=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit, sim = M.RegistrationLoss(), M.NCC()
    with pytest.raises(torch.linalg.LinAlgError):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="image_registration_models:make_affine_vxm",
                            factory_kwargs={"identity": False}) as rec:
            for mv, fv, ms, fs in DataLoader(M.PairDataset(8), batch_size=4):
                moved, moved_seg, disp, fixed_back = model(mv, fv, moving_seg=ms)
                loss = rec.loss_fn(moved, moved_seg, disp, fv, fs) + 0.1 * sim(mv, fixed_back)
                opt.zero_grad()
                loss.backward()
                opt.step()
    (bundle,) = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"], rep["cause"]) == (
        "", "aten.linalg_inv_ex", "LinAlgError", True, "invalid"), rep
    assert o["source"] == line_of("inv = torch.linalg.inv(a[:, :, :3])"), o
    assert "theta.weight, theta.bias are all 0" in rep["hint"], rep["hint"]
    assert "at the identity" in rep["hint"] and "no ratings" not in rep["hint"], rep["hint"]


def test_mutual_information_without_eps_names_the_log_not_a_model_output(tmp_path):
    """Parzen-window MI with narrow Gaussian bins and no eps: pair 1's joint histogram has
    bins whose soft weights underflow to 0 in float32 (6e-49 in float64), and
    ``pab * log(pab / papb)`` is 0 * -inf at step 0. The replay names the log on its line,
    row 1 (the one pair with empty bins, counted independently), underflow and log-space
    advice. It also said 'The 0s are the model's output[1] (the warped labels), made by
    grid_sampler_3d': any output whose least value is 0 matched the log's input; an output
    is named now only where its largest value is the input's too."""
    ev, bundle = fire("make_vxm", M.MutualInformation(), M.PairDataset(16), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "<loss>", "aten.log", "-inf", [1], "underflow"), rep
    assert o["source"] == line_of("mi = (pab * torch.log(pab / papb)).sum((1, 2))"), o
    assert "log space" in rep["hint"] and "model's output" not in rep["hint"], rep["hint"]
