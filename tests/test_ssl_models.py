"""Self-supervised learning and distillation steps, trained as their repos write them (a
momentum key encoder, a queue of keys, an EMA teacher), with a planted numerical bug: the
recorder fires at the planted step and ``nanreplay --json`` names the module, op, samples and
cause a numerics expert would name, and which model's state went bad first.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import ssl_models as S
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.load import read_step
from replay.rebuild import build
from replay.rerun import Runner

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def views(step: int, n: int = 8):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 12, generator=g)
    return x + 0.1 * torch.randn(n, 12, generator=g), x + 0.1 * torch.randn(n, 12, generator=g)


def test_moco_resumed_with_a_nan_key_in_its_queue_is_a_forward_event_of_the_queue(tmp_path):
    """MoCo resumed from a checkpoint whose queue holds a NaN key (the earlier run skipped its
    non-finite losses, after the forward had enqueued the key). Every row's negative logits
    hold NaN at step 0. The forward returns ``(logits, labels)`` with labels all 0 (the
    positive key first), which read as a graph batch's assignment vector: the recorder's
    search failed on it ('Segments' object has no attribute 'data') and the event said
    'phase unknown'. It is a forward event of the root, whose inputs were finite, and the
    replay names the queue, non-finite when the step began."""
    model = S.make_moco()
    with torch.no_grad():
        model.queue[:, 5] = float("nan")  # as the checkpoint holds it
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_moco"):
            for step in range(3):
                im_q, im_k = views(step)
                output, target = model(im_q=im_q, im_k=im_k)
                loss = crit(output, target)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    assert ev["samples"] == list(range(8)), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], rep["cause"]) == ("weights", "weights"), json.dumps(rep, indent=1)
    assert (o["param"], o["params"], o["tensor"]) == ("queue", ["queue"], "buffer"), o


def multi_crop(step: int, n: int = 6) -> list[torch.Tensor]:
    """Two global crops (12 px) and two local ones (6 px) of the same images."""
    g = torch.Generator().manual_seed(step)
    x = torch.rand(n, 3, 12, 12, generator=g)
    glob = [x + 0.05 * torch.randn(x.shape, generator=g) for _ in range(2)]
    return glob + [F.interpolate(x[..., i:i + 8, i:i + 8], size=6, mode="bilinear")
                   for i in (0, 4)]


@torch.no_grad()
def update_momentum(student, teacher, m: float) -> None:
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.data = pt.data * m + ps.data * (1.0 - m)


def test_dino_teacher_poisoned_by_its_ema_update_is_not_blamed_on_the_data(tmp_path):
    """DINO with the recorder on the student (one forward per crop, one loss): the teacher's
    momentum schedule gave NaN at step 2 (a cosine over 0 total steps), so from step 3 the
    teacher's outputs, the loss's targets, are NaN in every row while every crop is finite.
    The event is the loss argument (the teacher's output), at step 3; the hint said 'the batch
    itself holds NaN/Inf: check the data pipeline', and now says the loop computed that
    argument, every row of it, and to check the network behind it and its EMA update."""
    student = S.make_dino_student()
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad = False
    crit = S.DINOLoss()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(student, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_dino_student"):
            for step in range(6):
                views = multi_crop(step)
                teacher_out = [teacher(v) for v in views[:2]]
                student_out = [student(v) for v in views]
                loss = crit(teacher_out, student_out)
                opt.zero_grad()
                loss.backward()
                opt.step()
                update_momentum(student, teacher, float("nan") if step == 2 else 0.996)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["micro_batch"]) == \
        (3, "input", "loss_args[0][0]", 3), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["samples"], rep["cause"]) == \
        ("input", "loss_args[0][0]", list(range(6)), "input"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "not data the model took" in hint and "every row holds NaN" in hint, hint
    assert "EMA update" in hint and "the batch itself" not in hint, hint


def test_moco_whose_forward_updates_its_key_encoder_is_reproduced(tmp_path):
    """MoCo's forward updates the key encoder by momentum (``param_k.data = ...``: parameters
    that require no gradient, written by the forward). At step 3 a query view holds an
    unnormalised record (3e38), whose first linear layer overflows. Each re-run of the step
    updated the key encoder again, so the two re-runs disagreed: 'NOT reproduced ...
    nondeterminism'. The re-runs now start from the frozen parameters as the step began, and
    the report names the layer, the op, the sample and the overflow."""
    model = S.make_moco()
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-4)
    crit = torch.nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_moco"):
            for step in range(6):
                im_q, im_k = views(step)
                if step == 3:
                    im_q[2] = 3e38
                output, target = model(im_q=im_q, im_k=im_k)
                loss = crit(output, target)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "encoder_q.0"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "encoder_q.0", "aten.addmm", [2], "overflow"), json.dumps(rep, indent=1)


def test_a_what_if_stopped_by_a_bare_assert_in_the_model_says_where(tmp_path):
    """``--try drop=2`` on the MoCo bundle above: the smaller batch no longer divides the
    queue, and MoCo's bare ``assert self.K % n == 0`` raises. The what-if said 'raised
    AssertionError: in the model's code' (an empty message); it now names the line."""
    test_moco_whose_forward_updates_its_key_encoder_is_reproduced(tmp_path)
    bundle = next(tmp_path.glob("*.nan"))
    rep = nanreplay_json(bundle, "--try", "drop=2")
    line = next(i for i, text in enumerate((HERE / "ssl_models.py").read_text().splitlines(), 1)
                if "assert self.K % n == 0" in text)
    (t,) = rep["what_if"]
    assert t["error"].startswith(f"AssertionError at ssl_models.py:{line} in the model"), t


def test_moco_v3_momentum_of_nan_passed_to_forward_is_named_not_bad_weights(tmp_path):
    """moco-v3 passes the momentum to the forward, which writes the momentum encoder with it.
    A cosine schedule over 0 total epochs gives NaN at step 3: the forward makes the momentum
    encoder NaN before using it, and the recorder finds NaN weights the last update left
    finite. The report said 'the weights were already non-finite when the step began'; it now
    says the forward wrote them in this step, names the op and line that did, and the number
    passed to forward that it came from (cause input)."""
    model = S.make_moco_v3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="ssl_models:make_moco_v3"):
            for step in range(6):
                x1, x2 = views(step)
                m = float("nan") if step == 3 else 0.99
                loss = model(x1, x2, m)
                opt.zero_grad()
                loss.backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (3, "weights"), ev
    assert ev["params"][0] == "momentum_encoder.0.weight", ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["tensor"], o["op"], o["param"], rep["cause"]) == \
        ("input", "args[2]", "aten.mul", "momentum_encoder.0.weight", "input"), \
        json.dumps(rep, indent=1)
    line = next(i for i, text in enumerate((HERE / "ssl_models.py").read_text().splitlines(), 1)
                if "param_m.data = param_m.data * m" in text)
    assert o["source"] == f"ssl_models.py:{line}", o
    hint = rep["hint"]
    assert "were not non-finite when step 3 began" in hint and "args[2] = nan" in hint, hint
    assert "already non-finite" not in hint, hint


def test_byol_target_written_by_the_loops_ema_update_says_so(tmp_path):
    """BYOL with the recorder on the learner (online and target networks) and an optimizer over
    the online ones; the loop's EMA update after ``optimizer.step()`` took a NaN momentum at
    step 2, so the target encoder is NaN when step 3 begins: a weights event at step 3. The
    hint said to look for checkpoint loading or in-place edits; it now says these parameters
    require no gradient and the optimizer does not hold them, that the loop's own update wrote
    them, every element (as a non-finite coefficient makes), and to check its momentum."""
    model = S.make_byol()
    online = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(online, lr=3e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="ssl_models:make_byol"):
            for step in range(6):
                loss = model(*views(step))
                opt.zero_grad()
                loss.backward()
                opt.step()
                model.update_moving_average(float("nan") if step == 2 else 0.99)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"][0]) == \
        (3, "weights", "target_encoder.0.weight"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["param"], rep["cause"]) == \
        ("weights", "target_encoder.0.weight", "weights"), json.dumps(rep, indent=1)
    hint = rep["hint"]
    assert "the optimizer does not hold them" in hint and "the loop's own update" in hint, hint
    assert "every element of them is non-finite" in hint and "momentum" in hint, hint


def test_dino_loss_centre_is_bundled_and_re_run_as_the_step_found_it(tmp_path):
    """DINO's loss keeps a centre of the teacher's outputs (a buffer it replaces at each
    call). At step 3 the teacher temperature is 0 (a warmup schedule started from 0): the
    loss divides by 0. The bundle held the centre as the event step's loss call left it, not
    as the step found it, and each re-run of the loss moved it again, so the replay computed
    another loss than training did. The bundle now holds the centre as step 3 began, every
    re-run starts from it, and the report names the division in the loss."""
    student = S.make_dino_student()
    teacher = copy.deepcopy(student).requires_grad_(False)
    crit = S.DINOLoss()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(student, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_dino_student"):
            for step in range(6):
                views = multi_crop(step)
                teacher_out = [teacher(v) for v in views[:2]]
                student_out = [student(v) for v in views]
                if step == 3:
                    began, crit.teacher_temp = crit.center.clone(), 0.0
                loss = crit(teacher_out, student_out)
                opt.zero_grad()
                loss.backward()
                opt.step()
                update_momentum(student, teacher, 0.996)
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "loss")
    _, tensors = read_bundle(info.value.bundle_path)
    assert torch.equal(tensors["loss/center"], began), "the centre after the loss call"
    step = read_step(info.value.bundle_path, None)
    build(step, None, None, None)
    runner, after = Runner(step), []
    for _ in range(2):
        runner.run(backward=False, instrument=False)
        after.append(step.loss_fn.center.clone())
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], crit.center), after
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("loss", "<loss>", "aten.div", "invalid"), json.dumps(rep, indent=1)


def test_dropping_a_sample_of_a_multi_crop_step_drops_it_from_every_crop(tmp_path):
    """DINO multi-crop, one student forward per crop and one loss over all of them. At step 3
    image 2 of a local crop is unnormalised (3e38): the average pooling overflows in that
    crop's forward (micro-batch 2). ``--try drop=2`` removed row 2 from that crop only, and
    the loss, stacking the crops, raised 'stack expects each tensor to be equal size'. Every
    crop the loss compares holds the same images: the row is dropped from each, and the
    step re-runs finite without it."""
    student = S.make_dino_student()
    teacher = copy.deepcopy(student).requires_grad_(False)
    crit = S.DINOLoss()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(student, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_dino_student"):
            for step in range(6):
                views = multi_crop(step)
                if step == 3:
                    views[2][2] = 3e38
                teacher_out = [teacher(v) for v in views[:2]]
                student_out = [student(v) for v in views]
                loss = crit(teacher_out, student_out)
                opt.zero_grad()
                loss.backward()
                opt.step()
                update_momentum(student, teacher, 0.996)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["micro_batch"]) == \
        (3, "forward", "backbone.2", 2), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=2")
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.mean", [2], "overflow"), o
    (t,) = rep["what_if"]
    assert (t["finite"], t.get("error")) == (True, None), t


def test_dino_loss_with_a_numpy_temperature_schedule_is_rebuilt_and_names_the_op(tmp_path):
    """facebookresearch/dino's DINOLoss holds its teacher temperature schedule as a NumPy
    array; a warmup from 0 divides by 0 at epoch 0. The loss could not be rebuilt
    ('attribute(s) the bundle cannot store (teacher_temp_schedule (ndarray)') and the report
    said only that the gradient entering the model was NaN, cause unknown. The array is
    stored as a tensor and set back as NumPy: the report names the division in the loss."""
    pytest.importorskip("numpy")
    student = S.make_dino_student()
    teacher = copy.deepcopy(student).requires_grad_(False)
    crit = S.DINOLossNumpySchedule(32, 0.0, 0.04, 3, 10)
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(student, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="ssl_models:make_dino_student"):
            for step in range(3):
                views = multi_crop(step)
                teacher_out = [teacher(v) for v in views[:2]]
                loss = crit(teacher_out, [student(v) for v in views], epoch=step // 4)
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == \
        ("loss", "<loss>", "aten.div", "invalid"), json.dumps(rep, indent=1)
    assert not any("cannot store" in p for p in rep["problems"]), rep["problems"]
