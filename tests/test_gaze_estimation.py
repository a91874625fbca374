"""End to end on gaze estimation (``gaze_estimation_models``): a ResNet-style CNN over face
crops regressing (pitch, yaw) with a per-person calibration offset, eye-landmark heatmaps
decoded by soft-argmax, the angular error ``acos(cos_sim)`` in degrees over the rows a
validity mask keeps (the mask passed into ``forward`` too), through a DataLoader, Adam and
gradient clipping. Each planted bug fires under the recorder and is replayed with the CLI;
the healthy run raises no event and trains bit-identically with and without the recorder.

Two reports were wrong before: ``asin(-g[:, 1])`` of a gaze label kept in millimetres (334)
was told to clamp into [-1, 1] as if a cosine had rounded past 1, never naming the record;
and a Euclidean error's ``sqrt`` of ``(pred - gt) * valid`` at an unlabelled row was told to
fix or filter that "blank record", because the ``valid`` flag the loss was given is also a
model input (stored once, referenced by the loss) and was never looked at."""

from __future__ import annotations

import contextlib

import gaze_estimation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4  # the planted records are in the last step's batch
BAD = 5


def line_of(text: str) -> str:
    return source_line("gaze_estimation_models.py", text)


def train(make: str, crit, out_dir, record: bool = True, eps: float = 1e-8, **planted):
    """Adam and clipping over the DataLoader's batches; the mask is given to ``forward`` (no
    calibration update from an unlabelled row) and to the loss. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"gaze_estimation_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for face, person, gaze, lm, _, valid in M.gaze_batches(STEPS, **planted):
            g, xy, hm = model(face, person, valid)
            loss = loss_fn(g, xy, hm, gaze, lm, valid)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def fire(make: str, crit, tmp_path, code: int = 0, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(make, crit, tmp_path, **kw)
    return info.value.event, nanreplay_json(info.value.bundle_path, code=code)


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])


def test_healthy_gaze_training_raises_nothing_and_trains_bit_identically(tmp_path):
    """Unlabelled rows (zeros, ``valid`` 0) in the last batch under the clamped angular
    loss: no event, no bundle, the same weights and buffers with and without the recorder."""
    recorded = train("make_gaze", M.heatmap_loss, tmp_path, invalid=(2, BAD))
    plain = train("make_gaze", M.heatmap_loss, tmp_path, record=False, invalid=(2, BAD))
    assert not list(tmp_path.glob("*.nan"))
    a, b = recorded.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_gaze_label_in_millimetres_is_out_of_asins_domain_and_named_as_data(tmp_path):
    """One record's gaze label is the screen target minus the eye centre in millimetres,
    never normalised: ``vector_to_pitchyaw``'s ``asin(-g[:, 1])`` is given 334. The replay
    names the asin on that row in the loss, ``invalid``, and, since 334 is no cosine rounded
    past 1, the record out of scale with the others (a clamp would hide it as a wrong
    angle), with the drop that makes the step finite."""
    ev, rep = fire("make_gaze", M.pitchyaw_l1, tmp_path, mm=BAD)
    assert (ev["step"], ev["phase"]) == (STEPS - 1, "loss"), ev
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.asin", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("torch.asin(-v[:, 1])"), rep["origin"]
    hint = rep["hint"]
    assert f"sample(s) {BAD} of loss_args[3] reach 498" in hint, hint
    assert "out of scale" in hint and "out of its domain" in hint, hint
    assert f"--try drop={BAD}" in hint, hint


def test_soft_argmax_written_as_exp_over_its_sum_overflows_at_a_high_beta(tmp_path):
    """Soft-argmax with beta 50 written as ``exp(beta * h) / sum``: heatmap logits above
    ~1.8 overflow float32 at the first step. The replay names the exp in ``softargmax`` on
    the rows that overflowed, ``overflow``, and the max subtraction."""
    ev, rep = fire("make_gaze_exp", M.angular_loss, tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "softargmax"), ev
    assert origin(rep)[:4] == (0, "forward", "softargmax", "aten.exp"), rep
    assert rep["cause"] == "overflow" and rep["origin"]["made"] == "+inf", rep
    assert rep["origin"]["samples"] == ev["samples"] == [1, 2, 5, 6], rep["origin"]
    assert rep["origin"]["source"] == line_of("e = torch.exp(self.beta * flat)")
    assert "subtract the row max before exp" in rep["hint"], rep["hint"]


def test_landmarks_in_frame_pixels_underflow_the_rendered_target_heatmap(tmp_path):
    """One record's eye landmarks are in the detector's frame coordinates (~400 px) not the
    crop's: its rendered Gaussian target is exp of about -1e5 everywhere, 0, and normalising
    it by its sum is 0/0. The replay names that division in the loss on the record,
    ``underflow``, and the landmark data out of scale."""
    ev, rep = fire("make_gaze", M.heatmap_loss, tmp_path, off_crop=BAD)
    assert (ev["step"], ev["phase"]) == (STEPS - 1, "loss"), ev
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.div", [BAD], "underflow"), rep
    assert rep["origin"]["source"] == line_of("return g / g.sum((-2, -1), keepdim=True)")
    hint = rep["hint"]
    assert "0 by 0" in hint and f"sample(s) {BAD} of loss_args[4]" in hint, hint
    assert "out of scale" in hint, hint


def test_adam_with_eps_0_makes_the_calibration_of_an_absent_person_0_over_0(tmp_path):
    """Per-person calibration offsets under Adam with ``eps=0``: the first batch holds no
    row of some subjects, their embedding rows get a gradient of exactly 0, and Adam's
    ``m / sqrt(v)`` is 0/0 there. An optimizer event at step 0 (the bundle holds the
    weights after the update: not re-run), the embedding named, eps, and the rows it broke:
    exactly the subjects the batch lacks, told by the second moment the update left 0 there
    (the hint said no row before; the bundle's gradients are the next backward's NaN)."""
    ev, rep = fire("make_gaze", M.angular_loss, tmp_path, code=1, eps=0.0)
    assert (ev["step"], ev["phase"]) == (0, "optimizer"), ev
    assert (rep["event"]["step"], rep["cause"]) == (0, "optimizer"), rep
    assert rep["origin"]["param"] == "calib.weight", rep["origin"]
    hint = rep["hint"]
    assert "eps=0" in hint and "0/0" in hint, hint
    seen = set(next(iter(M.gaze_batches(STEPS)))[1].tolist())
    absent = [p for p in range(M.N_PEOPLE) if p not in seen]
    assert absent == [0, 4]
    assert f"only row(s) 0, 4 of {M.N_PEOPLE} of calib.weight non-finite, every one a row " \
        "whose gradient was all 0 (absent from the batch)" in hint, hint


def test_a_euclidean_error_masked_before_its_sqrt_names_the_flag_not_a_blank_record(
        tmp_path):
    """``sqrt(((pred - gt) * valid[:, None]) ** 2).sum(-1))``: an unlabelled row (label
    zeros, ``valid`` 0) is 0 under the root and sqrt's backward is 0 * inf there, a
    backward-only NaN. The replay names SqrtBackward0 in the loss on that row, ``invalid``;
    ``valid`` is a model input the loss is given too, and the hint names it as the flag to
    select by before the op, not a record to fix or filter."""
    ev, rep = fire("make_gaze", M.pitchyaw_euclid, tmp_path, invalid=(3,))
    assert (ev["step"], ev["phase"]) == (STEPS - 1, "backward"), ev
    assert origin(rep) == (STEPS - 1, "backward", "<loss>", "SqrtBackward0", [3], "invalid")
    assert rep["origin"]["source"] == line_of("err = torch.sqrt((diff ** 2).sum(-1))")
    hint = rep["hint"]
    assert "loss_args[5] (0/1 data) is 0 in exactly" in hint, hint
    assert "x[loss_args[5].bool()]" in hint and "where the data is made" not in hint, hint
    assert "vector_norm" in hint, hint


def test_a_label_stored_as_nan_then_masked_by_multiplication_is_named_as_input(tmp_path):
    """The dataset marks a skipped annotation with NaN and ``valid`` 0; the loss weights the
    angular error by ``valid`` (``err * valid``), and NaN * 0 is NaN. The recorder stops at
    the batch (an input event on that row); the replay says ``input`` and names the product
    that kept the NaN, with the fill-or-select advice."""
    ev, rep = fire("make_gaze", M.angular_loss, tmp_path, missing=(4,))
    assert (ev["step"], ev["phase"], ev["samples"]) == (STEPS - 1, "input", [4]), ev
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["samples"], rep["cause"]) == (
        STEPS - 1, "input", [4], "input"), rep
    hint = rep["hint"]
    assert "multiplied the NaN of loss_args[3]" in hint and "NaN * 0 is NaN" in hint, hint
    assert line_of("return (err * valid).sum()").split(None, 1)[0] in hint, hint


def train_pose(crit, out_dir, record: bool = True, **planted):
    """Head pose from the face crop (6D to R) under the geodesic loss, AdamW."""
    model = M.make_headpose()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="gaze_estimation_models:make_headpose") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for face, _, _, _, r, _ in M.gaze_batches(STEPS, **planted):
            loss = loss_fn(model(face), r)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_a_head_rotation_label_with_the_3dmm_scale_left_in_is_named_as_data(tmp_path):
    """One record's head-rotation label is a 3DMM fit's ``s * R`` (s = 180): the textbook
    geodesic loss's ``acos((trace - 1) / 2)`` is given -80.5. The replay names the acos on
    that row, ``invalid``, and the label out of scale (it said only to clamp into the
    domain before); the clamped loss on the same batches trains bit-identically with and
    without the recorder."""
    with pytest.raises(NonFiniteError) as info:
        train_pose(M.geodesic_loss_textbook, tmp_path / "bad", scaled=BAD)
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.acos", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("return torch.acos((tr - 1) / 2).mean()")
    hint = rep["hint"]
    assert f"sample(s) {BAD} of loss_args[1] reach 1" in hint and "out of scale" in hint, hint
    recorded = train_pose(M.geodesic_loss, tmp_path / "ok")
    plain = train_pose(M.geodesic_loss, None, record=False)
    assert not (tmp_path / "ok").exists() or not any((tmp_path / "ok").iterdir())
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
