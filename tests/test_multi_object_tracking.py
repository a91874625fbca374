"""End to end on multi-object tracking written as JDE/FairMOT/QDTrack-style trackers are
(``multi_object_tracking_models``): an L2-normalised re-id head over detection crops, a
Sinkhorn association of detections to tracks (log-domain, or the plain ``exp(-C / eps)``
kernel) with the inactive track slots masked by a track mask passed into ``forward``, a motion
head regressing the tracks' next boxes (cxcywh deltas) with a learned observation variance, and
a loss of focal loss on the assignment, GIoU written over xyxy, the Gaussian NLL and a
batch-hard triplet term. Trained with a DataLoader, Adam and gradient clipping. Each planted bug
fires under the recorder and is replayed with the CLI; the healthy run raises no event and
trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import itertools

import multi_object_tracking_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("multi_object_tracking_models.py", text)


def train(make: str, out_dir, record: bool = True, lr: float = 1e-3, triplet: bool = False,
          clamp: bool = True, steps: int | None = None, **plant):
    """Four steps of 8 frames (the planted frame 29 is row 5 of the last step); the first
    ``steps`` of them where given."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    crit = M.TrackingLoss(triplet=triplet, clamp=clamp)
    loader = torch.utils.data.DataLoader(M.Frames(**plant), batch_size=8)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"multi_object_tracking_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for dets, tracks, dbox, tbox, mask, match, target in itertools.islice(loader, steps):
            opt.zero_grad()
            assign, boxes, var, emb = model(dets, tracks, dbox, tbox, mask)
            loss = loss_fn(assign, boxes, var, emb, match, target, mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def fire(make: str, tmp_path, **plant):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path, **plant)
    return info.value.event, info.value.bundle_path


def origin(rep):
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_blank_crops_through_a_reid_head_normalised_without_eps(tmp_path):
    """A frame whose crops are all black (a decoder returning empty frames) through the
    bias-free re-id head: its embeddings are 0 and ``e / (e.norm() + 0)`` is 0/0 on that
    frame alone, in ``reid``."""
    ev, bundle = fire("make_tracker_no_eps", tmp_path, blank=(29,))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "reid", [5])
    rep = nanreplay_json(bundle)
    assert rep["reproduced"] and origin(rep) == ("forward", "reid", "aten.div", "nan", [5]), rep
    assert rep["origin"]["source"] == line_of("return e / (e.norm(dim=-1, keepdim=True)"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h and "exactly 0" in h, h
    # the blank crops are named beside the eps set to 0: a record to fix or filter too
    assert "args[0] is 0 everywhere in sample(s) 5 and not in any other sample" in h, h
    assert "--try drop=5" in h, h


def test_frame_without_active_tracks_in_plain_sinkhorn_names_the_track_mask(tmp_path):
    """A scene cut: every track slot of frame 29 inactive. The plain Sinkhorn kernel times the
    track mask is all 0 there, and its row normalisation is 0/0 on that frame; the hint names
    the track mask (forward's args[4]) as the empty record."""
    ev, bundle = fire("make_tracker_plain_sinkhorn", tmp_path, idle=(29,))
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "sinkhorn", [5])
    rep = nanreplay_json(bundle)
    assert origin(rep) == ("forward", "sinkhorn", "aten.div", "nan", [5]), rep
    assert rep["origin"]["source"] == line_of("k = k / k.sum(2, keepdim=True)"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in h, h
    assert "Sample(s) 5 are empty records: args[4] (0/1 data)" in h, h


def test_sinkhorn_with_a_small_eps_underflows_its_kernel(tmp_path):
    """The plain kernel ``exp(-C / 0.01)``: a detection whose cost to every track is above
    ~1 makes its whole row underflow to 0 in float32 (not in float64), and the row
    normalisation is 0/0 at step 0: underflow, with the log-domain advice."""
    ev, bundle = fire("make_tracker_sharp_sinkhorn", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        0, "forward", "sinkhorn", [2, 4]), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == ("forward", "sinkhorn", "aten.div", "nan", [2, 4]), rep
    assert rep["origin"]["source"] == line_of("k = k / k.sum(2, keepdim=True)"), rep
    h = rep["hint"]
    assert rep["cause"] == "underflow" and "smallest normal" in h and "logsumexp" in h, h


def test_giou_of_boxes_clipped_to_zero_width_is_0_over_0_in_the_loss(tmp_path):
    """A track and its target clipped to the image border (width 0): the tracked box keeps
    width 0 (``w * exp(dw)``) at the same centre, so GIoU's union is 0 and ``inter / union``
    is 0/0 in the loss, on that frame."""
    ev, bundle = fire("make_tracker", tmp_path, clipped=(29,))
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == ("loss", "<loss>", "aten.div", "nan", [5]), rep
    assert rep["origin"]["source"] == line_of("iou = inter / union"), rep
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"], rep["hint"]


def test_learned_observation_variance_stepped_below_zero_names_the_update(tmp_path):
    """The motion model's observation variance learned directly (no softplus), started at
    0.02: Adam's first step (lr 0.05) takes three of its four entries to -0.03, and the NLL's
    ``log(var)`` is NaN at step 1 in every frame. The hint names the parameter and the update
    that crossed 0, at the first entry holding the smallest value: those three differ in
    their last bits by the CPU's rounding of the gradient (entry 0 on an AMD EPYC's
    vectorised kernels, 1 with ``ATEN_CPU_CAPABILITY=default``), read from an unrecorded
    run's first update."""
    var = train("make_tracker_small_var", None, record=False, lr=0.05, steps=1).obs_var
    assert (var < 0).tolist() == [True, True, True, False], var
    low = int(var.detach().argmin())  # (torch's argmin: the first entry of the least value)
    ev, bundle = fire("make_tracker_small_var", tmp_path, lr=0.05)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("<loss>", "aten.log", "nan"), o
    assert o["source"] == line_of("nll = 0.5 * (r ** 2 / var + torch.log(var))"), o
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "the parameter obs_var" in h, h
    assert f"(Adam, lr 0.05, its update 1) moved obs_var[{low}] there from 0.02" in h, h


def test_batch_hard_triplet_with_an_unclamped_sqrt_is_a_backward_nan(tmp_path):
    """The batch-hard triplet loss's distances as ``d2.sqrt()`` of the pairwise squared
    differences: the diagonal (each embedding with itself) is 0, finite forward, but sqrt's
    backward there is 0/0: a backward event at step 0, in every frame."""
    ev, bundle = fire("make_tracker", tmp_path, triplet=True, clamp=False)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == ("backward", "<loss>", "SqrtBackward0", "nan", list(range(8))), rep
    assert rep["origin"]["source"] == line_of("else d2.sqrt()"), rep
    h = rep["hint"]
    assert rep["cause"] == "invalid" and "torch.linalg.vector_norm" in h, h


def test_nan_detection_box_is_an_input_event_on_that_frame(tmp_path):
    """A corrupt annotation line: a NaN detection box in frame 29, an input event there."""
    ev, bundle = fire("make_tracker", tmp_path, nan_at=(29,))
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "input", [5]), ev
    rep = nanreplay_json(bundle)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [5], "input"), rep


@pytest.mark.parametrize("triplet", [False, True])
def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path, triplet):
    """Log-domain Sinkhorn, eps's on, clamped distances: no event, bit-identical weights with
    and without the recorder."""
    recorded = train("make_tracker", tmp_path, triplet=triplet)
    plain = train("make_tracker", tmp_path, record=False, triplet=triplet)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
