"""End to end on human mesh recovery (``human_mesh_recovery_models``): HMR/SPIN's iterative
regressor of SMPL parameters with a 6D rotation head, a small SMPL-like body model, a
weak-perspective or CLIFF full-image camera, and SPIN's losses over a mixed batch of 3D- and
2D-labelled samples read through a DataLoader; the loop runs the body model on the SMPL fits for
the vertex targets, as SPIN's trainer does. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import human_mesh_recovery_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("human_mesh_recovery_models.py", text)


def bbox_of_size_zero(b):  # a person box collapsed to a point (every keypoint at one pixel)
    b["bbox"][5, 2] = 0.0


def all_invisible(b):  # an image none of whose joints is annotated
    b["kp2d"][2, :, 2] = 0.0


def no_3d_sample(b):  # a batch drawn from the 2D datasets alone
    for k in ("has_3d", "has_smpl", "joints", "pose"):
        b[k].zero_()


def train(make: str, out_dir, plant=None, steps: int = 4, record: bool = True, accum: int = 1,
          amp: bool = False, **loss_kw):
    """SPIN's loop: Adam, a step schedule, gradient clipping; the body model run on the SMPL
    fits (under no_grad) for the vertex targets; ``plant`` edits the last step's batch;
    ``accum`` micro-batches a step, ``amp`` the forward and loss under bf16 autocast."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    crit = M.HMRLoss(**loss_kw)
    torch.manual_seed(1)  # (the regressor's dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"human_mesh_recovery_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step, b in enumerate(M.loader()):
            if step == steps:
                break
            if plant is not None and step == steps - 1:
                plant(b)
            opt.zero_grad()
            for i in range(accum):
                mb = {k: v.chunk(accum)[i] for k, v in b.items()}
                with torch.no_grad():
                    gt_verts, _ = model.smpl(mb["betas"], pose=mb["pose"])
                with torch.autocast("cpu", torch.bfloat16, enabled=amp):
                    out = model(mb["img"], mb["bbox"], fg=mb["fg"])
                    loss = loss_fn(*out, mb["kp2d"], mb["joints"], mb["has_3d"], gt_verts,
                                   mb["has_smpl"], mb["pose"])
                (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(make: str, tmp_path, plant=None, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, plant, **kw)
    return info.value.event, info.value.bundle_path


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_procrustes_loss_on_unlabelled_samples_names_the_svd_backward_and_the_flag(tmp_path):
    """A PA-MPJPE training term run on every sample, then weighted by ``has_3d``: the 2D-only
    samples' 3D joints are zeros, their covariance 0, its singular values tied, and svd's
    backward is 0 * inf there though their weight is 0. The replay names the SVD's node, its
    line and exactly the unlabelled samples, and says to select the labelled samples before
    the op (not to filter the records, which are fine, nor an eps)."""
    ev, bundle = fire("make_hmr", tmp_path, w_pa=1.0)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "backward", "<loss>", "LinalgSvdBackward0", [1, 3, 5, 7]), o
    assert o["source"] == line_of("u, s, vh = torch.linalg.svd("), o
    assert rep["cause"] == "invalid", rep["cause"]
    hint = rep["hint"]
    assert "singular values" in hint and "loss_args[7] (0/1 data) is 0 in exactly" in hint
    assert "x[loss_args[7].bool()]" in hint and "where the data is made" not in hint, hint


def test_procrustes_on_the_labelled_samples_alone_trains_the_same_recorded_or_not(tmp_path):
    """SPIN's way, ``joints[has_3d.bool()]`` before the alignment: no event, bit-identical."""
    recorded = train("make_hmr", tmp_path, w_pa=1.0, pa_rows="labelled")
    plain = train("make_hmr", tmp_path, record=False, w_pa=1.0, pa_rows="labelled")
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def collinear_joints(b):  # a labelled sample whose 3D joints were annotated on one line
    t = torch.linspace(-0.5, 0.5, M.N_J)[:, None]
    b["joints"][4] = t * torch.tensor([0.0, 1.0, 0.0])


def test_procrustes_of_a_collinear_labelled_pose_names_its_sample_through_the_selection(
        tmp_path):
    """SPIN's selection of the 3D samples before the alignment, and a labelled sample (4) whose
    joints lie on one line: its covariance has rank 1, two singular values tied at 0. The
    replay names svd's node and sample 4 of the batch, though the SVD saw it as row 2 of
    ``joints[has_3d.bool()]``, and says the tie is the cause."""
    ev, bundle = fire("make_hmr", tmp_path, collinear_joints, w_pa=1.0, pa_rows="labelled")
    assert (ev["step"], ev["phase"]) == (3, "backward"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "LinalgSvdBackward0", [4]), o
    assert o["source"] == line_of("u, s, vh = torch.linalg.svd("), o
    assert rep["cause"] == "invalid" and "repeated singular values" in rep["hint"], rep["hint"]


def test_cliff_camera_of_a_zero_size_box_names_the_depth_and_its_eps(tmp_path):
    """CLIFF's ``tz = 2 f / (s * bbox_size)`` without its eps, a box of size 0 in sample 5:
    +inf at the reciprocal, NaN at the projection's division. The replay names the first op,
    its line, the step and the sample, and that the eps is exactly 0."""
    ev, bundle = fire("make_cliff_no_eps", tmp_path, bbox_of_size_zero)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [5]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten.reciprocal", "+inf",
                                                               [5]), o
    assert o["source"] == line_of("tz = 2 * FOCAL / bs"), o
    assert rep["cause"] == "invalid" and "1/0" in rep["hint"], rep["hint"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_cliff_camera_with_its_eps_takes_the_zero_box_without_an_event(tmp_path):
    """SPIN's ``+ 1e-9`` on the same batches: a huge but finite depth, no event, and the
    recorder changes nothing of what trains."""
    recorded = train("make_cliff", tmp_path, bbox_of_size_zero)
    plain = train("make_cliff", tmp_path, bbox_of_size_zero, record=False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def test_six_d_identity_written_as_columns_names_gram_schmidt_on_every_sample(tmp_path):
    """The mean pose's 6D written ``[1, 0, 0, 0, 1, 0]`` (two columns) where ``view(-1, 3, 2)``
    reads rows: its second column is 0, a zero-initialised head predicts exactly that, and the
    hand-written Gram-Schmidt divides 0 by 0 at step 0 in every sample. The replay names the
    division, its line, every sample, and the zero-initialised head whose 0 it normalised."""
    ev, bundle = fire("make_hmr_6d_columns", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["all_samples"]) == ("", "aten.div", "nan",
                                                                   True), o
    assert o["source"] == line_of("b2 = b2 / b2.norm("), o
    assert rep["cause"] == "invalid", rep["cause"]
    # (the head's zeros, not an eps: a unit vector needs the identity's nonzero part)
    assert "parameter decpose.weight, all 0 as the step began" in rep["hint"], rep["hint"]
    assert "give the vector a fixed nonzero part before normalising" in rep["hint"]


def test_pose_loss_rodrigues_of_the_unfitted_samples_names_its_rows_and_the_mask(tmp_path):
    """SPIN's pose loss turns the fits' axis-angle into matrices inside the loss, here with a
    Rodrigues without its eps: the 2D-only samples' zero poses are 0/0 at ``aa / angle``, on
    ``(B * J, 3)`` rows, and ``* has_smpl`` keeps the NaN. The replay names the division, its
    line, those samples (the rows of the flattened poses read back as samples), and the mask's
    product, not Rodrigues' own ``sin(angle) * K`` at that angle of 0."""
    ev, bundle = fire("make_hmr", tmp_path, w_pose=1.0, rodrigues_eps=0.0)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.div", "nan",
                                                               [1, 3, 5, 7]), o
    assert o["source"] == line_of("axis = aa / angle"), o
    mask = line_of("return (per_sample * has).sum() / n")
    assert rep["cause"] == "invalid" and f"aten.mul ({mask}) multiplied that NaN by a mask's 0" \
        in rep["hint"], rep["hint"]
    assert "select the weighted entries before the op" in rep["hint"], rep["hint"]


def test_image_with_every_joint_invisible_under_a_confidence_normalised_loss(tmp_path):
    """Each image's 2D error divided by the sum of its confidences: 0/0 for image 2, none of
    whose joints is annotated. The replay names the division in the loss and that image, as a
    sample with no valid entry (not a graph's isolated row), and says to leave it out or floor
    the count."""
    ev, bundle = fire("make_hmr", tmp_path, all_invisible, kp_norm="conf")
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten.div", [2]), o
    assert o["source"] == line_of("return ((conf * err).sum(1) / conf.sum(1)).mean()"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]
    assert "each sample's sum of its 0/1 weights" in rep["hint"], rep["hint"]
    assert "clamp(min=1)" in rep["hint"] and "0 in sample(s) [2]" in rep["hint"], rep["hint"]


def test_invisible_image_in_the_second_bf16_micro_batch_names_its_micro_batch_row(tmp_path):
    """The same loss under bf16 autocast with two micro-batches of 4 a step: image 6 of the
    loader's batch, none of whose joints is visible, is row 2 of micro-batch 1."""
    def invisible_6(b):
        b["kp2d"][6, :, 2] = 0.0

    ev, bundle = fire("make_hmr", tmp_path, invisible_6, kp_norm="conf", accum=2, amp=True)
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (3, "loss", 1), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["micro_batch"]) == (
        "<loss>", "aten.div", [2], 1), o
    assert rep["cause"] == "invalid" and "0 in sample(s) [2]" in rep["hint"], rep["hint"]


def test_batch_without_a_3d_sample_names_the_masked_mean_over_none(tmp_path):
    """The 3D terms summed over the labelled samples and divided by their count: a batch drawn
    from the 2D datasets alone is 0/0. No sample is to blame; the hint floors the count."""
    ev, bundle = fire("make_hmr", tmp_path, no_3d_sample, masked="ratio")
    assert (ev["step"], ev["phase"]) == (3, "loss"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("<loss>", "aten.div", []), o
    assert o["source"] == line_of("return (per_sample * has).sum() / n"), o
    assert rep["cause"] == "invalid" and "clamp_min(1)" in rep["hint"], rep["hint"]


def test_unrecorded_batch_without_a_3d_sample_poisons_the_weights(tmp_path):
    """Without the recorder the same run updates the weights to NaN: the event is no false
    alarm."""
    model = train("make_hmr", tmp_path, no_3d_sample, record=False, masked="ratio")
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("accum, amp", [(1, False), (2, True)])
def test_healthy_losses_take_the_hard_batches_without_an_event(tmp_path, accum, amp):
    """SPIN's mean 2D loss, the floored 3D count and its pose loss (Rodrigues with its eps) on
    a batch with no 3D sample and an image with no visible joint, also in bf16 micro-batches:
    no event, bit-identical weights recorded or not."""
    def both(b):
        no_3d_sample(b)
        all_invisible(b)

    kw = {"accum": accum, "amp": amp, "w_pose": 1.0, "w_pa": 1.0, "pa_rows": "labelled"}
    recorded = train("make_hmr", tmp_path, both, **kw)
    plain = train("make_hmr", tmp_path, both, record=False, **kw)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)


def test_rodrigues_of_the_zero_poses_in_the_loop_is_named_as_the_vertex_target(tmp_path):
    """The loop's body model on the SMPL fits with a Rodrigues without its eps: the 2D-only
    samples' zero poses are 0/0, their vertex targets NaN. That call runs before the model's
    forward opens the step, so nothing records it: the event and the replay name the loss's
    vertex target, its unlabelled samples, as input, and the mask multiplying the NaN by 0."""
    ev, bundle = fire("make_hmr_gt_rodrigues_no_eps", tmp_path)
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        0, "input", "loss_args[8]", [1, 3, 5, 7]), ev
    rep = nanreplay_json(bundle)
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [1, 3, 5, 7]), rep["origin"]
    assert "NaN * 0 is NaN" in rep["hint"], rep["hint"]


def no_foreground(b):  # a person the segmenter missed: an empty mask
    b["fg"][3] = False


def test_part_attention_of_an_empty_person_mask_names_the_softmax_and_the_image(tmp_path):
    """PARE-style attention pooling, the background's logits filled with -inf: image 3's
    segmentation is empty, its softmax over only -inf is 0/0. The replay names the softmax, its
    line, the image and the fully masked row, the -inf fill as intended."""
    ev, bundle = fire("make_hmr_attention", tmp_path, no_foreground)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [3]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("", "aten._softmax", "nan", [3]), o
    assert o["source"] == line_of("att = torch.softmax(logits, dim=1)"), o
    assert rep["cause"] == "invalid" and "every entry is -inf" in rep["hint"], rep["hint"]
    assert "keep at least one key per row" in rep["hint"], rep["hint"]


def test_part_attention_with_background_masked_trains_the_same_recorded_or_not(tmp_path):
    """The same -inf fills of every image's background, each image keeping some foreground:
    infinities that stay inside the softmax raise nothing, and nothing of training changes."""
    recorded = train("make_hmr_attention", tmp_path, amp=True)
    plain = train("make_hmr_attention", tmp_path, amp=True, record=False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)
