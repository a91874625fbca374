"""Object detection as its repositories write it (box ops by hand, targets a list of per-image
dicts from a ``collate_fn``, images without boxes, losses over the images in a loop), with a
planted bug: the recorder fires at the planted step, and ``nanreplay --json`` names the op,
the image and the cause."""

from __future__ import annotations

from pathlib import Path

import detection_models as D
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent

# Image 10 (the third of batch 2) has a box of zero width: [20, 6, 20, 18], a box clipped to a
# crop's edge, or an annotation tool's click.
DEGENERATE = {10: [[4, 4, 12, 14], [20, 6, 20, 18]]}


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, factory: str, ds, crit=None, steps: int = 6):
    model = getattr(D, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"detection_models:{factory}"):
        for step, (images, targets) in enumerate(D.loader(ds)):
            if step == steps:
                break
            opt.zero_grad()
            # torchvision's detection models compute their losses themselves in training
            loss = crit(model(images), targets) if crit is not None else model(images, targets)
            loss.backward()
            opt.step()


def test_a_healthy_fcos_run_with_images_without_boxes_raises_nothing(out_dir):
    _train(out_dir, "make_fcos", D.Shapes(empty=(1, 5, 6, 8, 9)), D.FCOSLoss())
    assert not list(Path(out_dir).glob("*.nan"))


def test_a_box_of_zero_width_is_named_by_its_image_and_called_bad_data(out_dir):
    """RetinaNet's box coder takes log(w_gt / w_anchor) of each matched box; a box of zero
    width is -inf. The loss loops over the images, so the op's output, the matched boxes
    ``(P, 4)``, has no batch dimension: the report named no samples, and its hint said to
    clamp the log's input (x.clamp_min(eps)), which trains toward log(eps). It now names the
    image whose target dict the value came from, and says the op took nothing the model
    learns: a degenerate record, to drop where the data is made."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_retinanet", D.Shapes(empty=(1,), boxes=DEGENERATE), D.RetinaLoss())
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf", [2])
    assert o["source"] == f"detection_models.py:{_line('torch.log(gw / aw)')}"
    assert rep["cause"] == "invalid", rep["hint"]
    assert "from the batch's data alone" in rep["hint"] and "degenerate" in rep["hint"]
    assert "clamp_min" not in rep["hint"], rep["hint"]


def test_dropping_an_image_drops_its_target_dict(out_dir):
    """``--try drop=2`` took row 2 from the images but left the list of 4 target dicts, and
    its check of the loss's integer tensors for mined index tuples read each image's 0-d
    ``image_id``: 'IndexError: tuple index out of range'. The image's dict now goes with it,
    and the step is finite without image 2 (not without image 1)."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_retinanet", D.Shapes(empty=(1,), boxes=DEGENERATE), D.RetinaLoss())
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=2", "--try", "drop=1")
    two, one = rep["what_if"]
    assert two["try"] == "drop=2" and two["finite"] is True, two
    assert one["finite"] is False and one["origin"]["phase"] == "loss", one


def test_a_loss_inside_the_model_counts_the_images_not_their_boxes(out_dir):
    """``model(images, targets)`` returning its loss, as torchvision's detectors do: the
    batch's size was voted from every tensor's sizes, and the targets' boxes ``(k, 4)`` and
    labels ``(k,)`` outvoted the 4 images (a batch 'of 1'), so no sample was named. The
    list of per-image dicts now says the batch's size."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_detector", D.Shapes(empty=(1,), boxes=DEGENERATE))
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "forward", "criterion"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["batch_size"]) == \
        ("criterion", "aten.log", [2], 4), o
    assert rep["cause"] == "invalid" and "degenerate" in rep["hint"], rep["hint"]


def test_a_corrupt_image_in_a_list_of_images_is_named_as_its_sample(out_dir):
    """torchvision's detectors take a list of images (their sizes may differ). Image 9 (the
    second of batch 2) decoded with NaN pixels in channel 2: the event named the input
    args[0][1] and, as its samples, the rows of that one image (its channel, [2]), or none once
    the targets set the batch's size, and the replay then said it 'is not per sample: every
    sample of the batch goes through it (a mask, a bias or a table)'. An image of such a list
    is its sample's."""
    ds = D.Shapes(empty=(1,))
    ds.items[9][0][2, 5:9, 5:9] = float("nan")  # a corrupt decode (channel 2)
    model = D.make_list_detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir,
                            factory="detection_models:make_list_detector"):
            for images, targets in D.loader(ds):
                loss = model(list(images), targets)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == \
        (2, "input", "args[0][1]", [1]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == ("args[0][1]", [1], "input"), o
    assert "not per sample" not in rep["hint"] and "data pipeline" in rep["hint"], rep["hint"]


def test_a_nan_box_in_a_target_dict_is_named_as_its_image(out_dir):
    """A box of image 10 (the third of batch 2) converted from normalised coordinates with a
    width of 0 is NaN: a loss target ``(k, 4)`` without a batch dimension, in the list of
    per-image dicts. Neither the event nor the report named a sample."""
    ds = D.Shapes(empty=(1,))
    ds.items[10][1]["boxes"][1, 2] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_retinanet", ds, D.RetinaLoss())
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (2, "input", [2]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["tensor"], o["samples"], rep["cause"]) == \
        ('loss_args[1][2]["boxes"]', [2], "input"), o


def test_a_batch_without_a_box_divides_by_zero_positives_and_blames_no_image(out_dir):
    """A focal loss normalised by the bare number of positives, and a batch (images 8-11) of
    background only: x/0. Each image's targets are followed through the loss, but the count
    is over all of them: no image is named, nor called a bad record."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_fcos", D.Shapes(empty=(8, 9, 10, 11)), D.FCOSLoss(None))
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.div", [], "invalid"), o
    assert "count.clamp_min(1)" in rep["hint"] and "degenerate" not in rep["hint"]


def test_a_centerness_target_of_every_location_is_no_bad_record(out_dir):
    """The centerness target taken at every location and masked after: a background
    location's l, t, r, b are 0 in every image, and min / max is 0/0 there. Made of the
    targets alone, but in every image: the loss's code, not a degenerate record."""
    with pytest.raises(NonFiniteError) as info:
        _train(out_dir, "make_fcos", D.Shapes(empty=(1,)),
               D.FCOSLoss(centerness_everywhere=True))
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], rep["cause"]) == ("aten.div", "nan", "invalid"), o
    assert o["source"] == f"detection_models.py:{_line('return torch.sqrt((lr.min')}"
    assert "degenerate" not in rep["hint"] and "denominator" in rep["hint"], rep["hint"]


def test_a_feature_map_one_pixel_wide_is_a_size_not_a_setting(out_dir):
    """RoIAlign written with grid_sample(align_corners=True) normalises by (W - 1); the
    stride-32 map of a 32-pixel image is 1 x 1, and x / 0 is +inf. The hint said to find 'the
    setting that made it 0 (a drop probability of 1, a temperature annealed to 0)'; a whole
    number 0 is a size or count the code computed."""
    model = D.make_two_stage()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="detection_models:make_two_stage"):
            for images, targets in D.loader(D.Shapes(empty=(1,))):
                rois, labels = D.proposals(targets)
                opt.zero_grad()
                crit(model(images, rois), labels).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["module"]) == (0, "pooler")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], rep["cause"]) == \
        ("pooler", "aten.div", "+inf", "invalid"), o
    assert o["source"] == f"detection_models.py:{_line('gx = (x1[:, None]')}"
    assert "by the number 0" in rep["hint"] and "W - 1" in rep["hint"], rep["hint"]
    assert "drop probability" not in rep["hint"], rep["hint"]


def _line(text: str) -> int:
    lines = (HERE / "detection_models.py").read_text().splitlines()
    return next(i for i, s in enumerate(lines, 1) if text in s)
