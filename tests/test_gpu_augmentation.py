"""End to end: augmentation done on tensors inside the training step, as Kornia and
torchvision.transforms.v2 do it on the GPU (``gpu_augmentation_models``: colour jitter through
RGB<->HSV, a crop by a homography solved from each image's box, gamma, RandAugment's policy,
differentiable augmentations with learned magnitudes), on batches from a DataLoader with
workers, trained under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import random

import gpu_augmentation_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

BS = 8


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("gpu_augmentation_models.py", text)


def train(out_dir, factory: str, data: M.Images, steps: int = 4, workers: int = 0,
          loop_aug=None, boxes: bool = False, spy=None):
    """SGD with Nesterov momentum and a one-cycle schedule, label smoothing; ``loop_aug`` runs
    on each batch in the loop before the network (the Kornia tutorial's pattern), ``boxes``
    passes each image's box to ``forward``; ``spy(model)`` before training."""
    model = getattr(M, factory)()
    if spy is not None:
        spy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    loader = DataLoader(data, batch_size=BS, num_workers=workers)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"gpu_augmentation_models:{factory}") as rec:
        for step, (x, y, box) in enumerate(loader):
            if step == steps:
                break
            if loop_aug is not None:
                x = loop_aug(x)
            loss = rec.loss_fn(model(x, box) if boxes else model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def event(out_dir, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(out_dir, *args, **kwargs)
    return info.value.event, nanreplay_json(info.value.bundle_path)


def test_healthy_augmentation_pipelines_raise_no_event(tmp_path):
    """Kornia's tutorial pipeline in the loop (a crop by homography, affine with black
    corners, colour jitter through HSV with its eps) on batches from two workers, the jitter
    inside the model on blank frames, learned magnitudes, RandAugment, per-image
    standardisation: no event."""
    random.seed(0)
    train(tmp_path, "make_resnet", M.Images(32, gray=[3]), workers=2,
          loop_aug=M.DataAugmentation())
    train(tmp_path, "make_jitter", M.Images(32, blank=[5, 13]))
    train(tmp_path, "make_learned", M.Images(32, gray=[3]))
    train(tmp_path, "make_randaugment", M.Images(32))
    train(tmp_path, "make_standardized", M.Images(32))
    assert not list(tmp_path.rglob("*.nan"))


def test_kornia_s_eps_lost_in_float16_is_the_fix_not_log_space(tmp_path):
    """kornia's rgb_to_hsv guards with eps=1e-8, which float16 (an FFCV-style half batch)
    rounds to 0: black pixels are 0/0 again. The hint led with float32 and log-space rewrites
    (log_softmax, a Cox loss, TRADES' KL) and named the lost eps only at its end."""
    ev, rep = event(tmp_path, "make_jitter_half",
                    M.Images(32, blank=[2, 6], dtype=torch.float16))
    assert (ev["step"], ev["phase"]) == (0, "forward")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["dtype"], o["samples"]) == (
        True, "underflow", "aug.jitter", "aten.div", "float16", [2, 6]), rep
    assert o["source"] == line_of("s = deltac / (max_rgb + eps)")
    assert "the eps 1e-08 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert "log space" not in rep["hint"] and "log_softmax" not in rep["hint"], rep["hint"]


def test_gamma_after_standardisation_says_to_keep_the_base_non_negative(tmp_path):
    """A random gamma, x ** g, placed after a per-image standardisation: every image has
    negative values. The hint said 'x.clamp_min(eps) before log or sqrt'."""
    ev, rep = event(tmp_path, "make_gamma_after_standardize", M.Images(32))
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "aug.1")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "aug.1", "aten.pow", list(range(BS))), rep
    assert o["source"] == line_of("return x ** g")
    assert "negative number to a fractional power" in rep["hint"], rep["hint"]
    assert "x.clamp_min(0) ** p" in rep["hint"] and "before a normalisation" in rep["hint"], \
        rep["hint"]
    assert "before log or sqrt" not in rep["hint"], rep["hint"]


def test_a_learned_saturation_s_backward_names_the_drawn_blank_frames(tmp_path):
    """Faster AutoAugment-style magnitudes, the saturation applied to the samples kornia's p
    drew: where(v > 0, (v - min) / v, 0) is finite forward, but the division's backward at a
    blank frame's v = 0 sends NaN into the brightness's magnitude. That gradient's rows are
    the drawn ones, no sample's: the report named none."""
    blank = [9, 10, 11, 12, 13, 14]
    models = []
    ev, rep = event(tmp_path, "make_learned_p", M.Images(32, blank=blank), spy=models.append)
    assert (ev["step"], ev["phase"], ev["params"]) == (1, "backward", ["aug.0.magnitude"])
    o = rep["origin"]
    # the blank frames of step 1 that the event step's draw picked
    drawn = [i for i in models[0].aug[1].batch_prob.nonzero().flatten().tolist()
             if i + BS in blank]
    assert 0 < len(drawn) < len(blank), drawn
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "aug.1.transform", "DivBackward0", drawn), rep
    assert o["source"] == line_of("s = torch.where(v > 0, (v - x.amin(")
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_a_box_of_no_width_is_named_as_a_degenerate_record_not_a_ridge(tmp_path):
    """kornia's crop_and_resize solves each image's homography from its box: an annotation
    whose two x coordinates are one column makes that 8x8 system singular, and
    torch.linalg.solve raises in the forward. The hint said to use lstsq or pinv or add a
    ridge, which would crop a made-up box; the matrix is made from the boxes alone."""
    with pytest.raises(torch.linalg.LinAlgError):
        train(tmp_path, "make_resnet", M.Images(32, thin=[12]), workers=2, boxes=True)
    bundle, = tmp_path.glob("*.nan")
    assert bundle.name.startswith("step00000001-")
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "", "aten._linalg_solve_ex", "LinAlgError", [12 - BS]), rep
    assert o["source"] == line_of("h = torch.linalg.solve(a, b)")
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert "box of zero width" in rep["hint"] and "use torch.linalg.lstsq" not in rep["hint"], \
        rep["hint"]


def test_an_augmentation_applied_to_the_drawn_samples_names_them_not_the_batch(tmp_path):
    """kornia's p: out[to_apply] = jitter(x[to_apply]). The jitter's call gets only the drawn
    rows, so the op's rows named no sample and the report said every sample; its row r is
    the sample of the r-th drawn one."""
    spoiled = []  # the rows of the augmented batch holding NaN, as the loop saw them

    def spy(model):
        model.aug.register_forward_hook(lambda m, a, out: spoiled.append(
            (~out.isfinite()).flatten(1).any(1).nonzero().flatten().tolist()))

    ev, rep = event(tmp_path, "make_jitter_p_no_eps",
                    M.Images(64, blank=[9, 10, 11, 12, 13, 14]), steps=8, spy=spy)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "aug.transform")
    o = rep["origin"]
    assert 0 < len(spoiled[-1]) < BS, spoiled
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "aug.transform", "aten.div", spoiled[-1]), rep
    assert o["source"] == line_of("s = deltac / (max_rgb + eps)")


def test_the_step_s_draws_are_replayed_from_python_s_random_and_the_code_s_generator(
        tmp_path):
    """RandAugment draws its ops with random.choices: step 3 draws posterize then
    autocontrast, whose (x - lo) / (hi - lo) is 0/0 on the blank frame. A jitter drawing its
    factors from a generator of the augmentation code's own, at module level (no module's
    attribute): the replay drew from it as it stood, other factors, and named other frames
    than those the step spoiled."""
    random.seed(0)
    ev, rep = event(tmp_path / "randaugment", "make_randaugment", M.Images(64, blank=[26]),
                    steps=6)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", "aug")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "aug", "aten.div", [26 - 3 * BS]), rep
    assert o["source"] == line_of("return ((x - lo) / (hi - lo))")

    spoiled = []  # the rows of the jittered batch holding NaN, as the loop saw them

    def spy(model):
        model.aug.register_forward_hook(lambda m, a, out: spoiled.append(
            (~out.isfinite()).flatten(1).any(1).nonzero().flatten().tolist()))

    blank = [9, 10, 11, 12, 13, 14, 17, 18, 19, 20, 21, 22]
    ev, rep = event(tmp_path / "seeded", "make_seeded_jitter_no_eps", M.Images(64, blank=blank),
                    steps=8, spy=spy)
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "forward", "aug")
    assert 0 < len(spoiled[-1]) < 6, spoiled
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "aug", "aten.div", spoiled[-1]), rep


def test_the_kornia_pipeline_in_the_loop_is_input_and_in_forward_its_op(tmp_path):
    """The Kornia tutorial's pattern: the pipeline (no_grad) runs on the batch before the
    model, so the recorder sees its NaN (saturation without eps at the affine's black
    corners) as data, on the frames it spoiled. The same pipeline as the model's first
    module, the same draws: the op, its line and the same frames."""
    ev, rep = event(tmp_path / "loop", "make_resnet", M.Images(32), workers=2,
                    loop_aug=M.DataAugmentation(eps=0.0))
    assert (ev["step"], ev["phase"], ev["tensor"]) == (0, "input", "batch")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"]) == (True, "input", "batch"), rep
    spoiled = o["samples"]
    assert spoiled == ev["samples"] and 0 < len(spoiled) < BS, rep
    assert "an augmentation the loop ran on the batch" in rep["hint"], rep["hint"]
    ev, rep = event(tmp_path / "model", "make_pipeline_no_eps", M.Images(32), workers=2)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "aug.jitter")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "aug.jitter", "aten.div", spoiled), rep
    assert o["source"] == line_of("s = deltac / (max_rgb + eps)")
