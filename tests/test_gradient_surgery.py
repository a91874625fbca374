"""End to end on multi-task learning with gradient manipulation (``gradient_surgery_models``):
a shared conv trunk with segmentation, depth and scene heads; PCGrad's projections written
into ``p.grad`` by hand, MGDA's min-norm scales over normalised task gradients, GradNorm's
task weights (autograd.grad with create_graph at the last shared layer, renormalised after
each update), uncertainty weighting under bfloat16 autocast with a ``-inf`` class mask.
Each planted failure of the domain fires under the recorder and is replayed with the CLI;
the healthy versions raise no event and train bit-identically with and without the
recorder."""

from __future__ import annotations

import gradient_surgery_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K = 3  # the step every planted failure is in
TRUNK = ["trunk.0.weight", "trunk.0.bias", "trunk.1.weight", "trunk.1.bias",
         "trunk.3.weight", "trunk.3.bias", "trunk.4.weight", "trunk.4.bias"]


def line_of(text: str) -> str:
    return source_line("gradient_surgery_models.py", text)


def no_depth(step, x, seg, depth, scene):
    """Step K's batch comes from a split without depth maps (every pixel 0: no reading)."""
    if step == K:
        depth.zero_()


def no_labels(step, x, seg, depth, scene):
    """Step K's batch has no labelled pixel for segmentation (every one ignore_index)."""
    if step == K:
        seg.fill_(M.IGNORE)


def fire(train, tmp_path, *args, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, *args, **kw)
    return info.value.event, info.value.bundle_path


def test_pcgrad_over_a_task_with_a_zero_gradient_names_that_tasks_output(tmp_path):
    """A batch without depth: the guarded depth loss is 0 with a gradient of exactly 0, and
    PCGrad's ``min(g_i·g_j, 0) / ||g_j||^2`` is 0 · 0/0 = NaN in every shared parameter's
    gradient the loop writes. The gradients that reached the outputs were finite, so the
    replay says the loop's own code wrote them, and names the output whose gradient was
    exactly 0, out["depth"], with the eps to add to ||g_j||^2; before, it said only 'a
    division by a norm that is 0'."""
    ev, bundle = fire(M.train_pcgrad, tmp_path, plant=no_depth)
    assert (ev["step"], ev["phase"], ev["kind"], ev["params"]) == (K, "backward", "nan", TRUNK)
    rep = nanreplay_json(bundle, code=1)  # (not reproduced: the loop's code is not re-run)
    o = rep["origin"]
    assert (o["phase"], o["param"], rep["cause"]) == ("backward", "trunk.0.weight",
                                                     "not_reproduced"), rep
    hint = rep["hint"]
    assert "written by the loop's own code" in hint, hint
    assert "model's output out[\"depth\"] was exactly 0 in every element" in hint, hint
    assert "PCGrad's g_i·g_j / ‖g_j‖²" in hint and "‖g_j‖² + 1e-12" in hint, hint
    assert "out[\"seg\"]" not in hint and "out[\"scene\"]" not in hint, hint


def test_unrecorded_pcgrad_over_a_zero_task_gradient_goes_nan_silently(tmp_path):
    """Without the recorder the same run's shared weights turn NaN: the event is the bug."""
    model = M.train_pcgrad(tmp_path, plant=no_depth, record=False)
    assert not torch.isfinite(model.trunk[0].weight).all()


def test_mgda_loss_normaliser_of_a_zero_loss_names_a_nan_factor_of_the_whole_loss(tmp_path):
    """MGDA with Sener & Koltun's 'loss+' normaliser (task loss times gradient norm): the depth
    loss is 0 at step K, its normalised gradient 0/0, the Frank-Wolfe scales NaN, and the
    scaled loss computed in the loop sends NaN into every sample of every head. The replay
    names the gradient entering output 0 on all 8 rows and says one NaN factor scaled the
    whole loss (the task weights the loop computed), not a record; before, only to pass
    loss_fn."""
    ev, bundle = fire(M.train_mgda, tmp_path, plant=no_depth)
    assert (ev["step"], ev["phase"], ev["kind"]) == (K, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["phase"], o["module"], o["tensor"], o["samples"]) == (
        "loss", "<loss>", 'grad of the model output 0 (out["seg"])', list(range(8))), o
    hint = rep["hint"]
    assert "every sample of each of the model's outputs received a NaN gradient" in hint, hint
    assert "one NaN factor likely scaled the loss as a whole" in hint, hint
    assert "MGDA's min-norm scales" in hint and "a gradient normaliser of 0" in hint, hint


def test_a_record_with_a_nan_target_is_not_called_a_nan_factor(tmp_path):
    """The same loop as the equal-weight baseline (every scale 1), with an unmasked MSE depth
    loss and one record's depth map holding a NaN hole (a map converted from a format that
    stores missing readings as NaN): the NaN enters that record's rows only, which the
    replay names, and the hint does not blame a factor of the whole loss."""
    def corrupt(step, x, seg, depth, scene):
        if step == K:
            depth[6, 2, 3] = float("nan")
    ev, bundle = fire(M.train_mgda, tmp_path, plant=corrupt, kind="equal",
                      depth_loss=M.depth_mse)
    rep = nanreplay_json(bundle)
    assert ev["step"] == K, ev
    assert rep["reproduced"] is True, rep
    assert (rep["origin"]["tensor"], rep["origin"]["samples"]) == (
        'grad of the model output 1 (out["depth"])', [6]), rep["origin"]
    assert "NaN factor" not in rep["hint"], rep["hint"]


def test_depth_l1_over_a_batch_with_no_valid_pixel_names_the_empty_mean(tmp_path):
    """The unguarded masked L1 ``(pred[valid] - gt[valid]).abs().mean()`` over a batch
    without depth readings: the mean of no element is 0/0, a loss event named at that mean."""
    ev, bundle = fire(M.train_weighted, tmp_path, M.MultiTaskLoss(), plant=no_depth)
    assert (ev["step"], ev["phase"], ev["kind"]) == (K, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], rep["cause"]) == (
        "loss", "<loss>", "aten.mean", "invalid"), rep
    assert o["source"] == line_of("return (pred[valid] - gt[valid]).abs().mean()"), o
    assert "an empty selection" in rep["hint"], rep["hint"]


def test_segmentation_batch_with_every_pixel_ignored_names_the_cross_entropy(tmp_path):
    """Every pixel of step K's segmentation labels is ignore_index: cross_entropy's mean
    divides by a total weight of 0. Named at the loss's nll_loss2d, with ignore_index 255."""
    crit = M.MultiTaskLoss(depth_loss=M.depth_l1_guarded)
    ev, bundle = fire(M.train_weighted, tmp_path, crit, plant=no_labels)
    assert (ev["step"], ev["phase"], ev["kind"]) == (K, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], rep["cause"]) == ("aten.nll_loss2d_forward", "invalid"), rep
    assert o["source"] == line_of("return [F.cross_entropy(out[\"seg\"], seg, ignore_index=IGNORE),"), o
    assert "every target of the batch is ignore_index (255)" in rep["hint"], rep["hint"]


def same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("run", ["pcgrad_guarded", "pcgrad_amp", "mgda", "gradnorm",
                                 "uncertainty"])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, run):
    """PCGrad with the eps on ||g_j||^2 over a batch without depth (a task gradient of exactly
    0), the same under float16 autocast with a GradScaler (task gradients of the scaled
    losses), MGDA without a normaliser, GradNorm (double backward at the last shared layer,
    weights renormalised in place) and uncertainty weighting under bfloat16 autocast with the
    scene head's ``-inf`` class mask (allowed): no event, bit-identical weights with and
    without the recorder."""
    train = {
        "pcgrad_guarded": lambda d, record: M.train_pcgrad(
            d, plant=no_depth, surgery=M.pcgrad_guarded, record=record),
        "pcgrad_amp": lambda d, record: M.train_pcgrad(
            d, plant=no_depth, surgery=M.pcgrad_guarded, record=record, amp=True),
        "mgda": lambda d, record: M.train_mgda(d, plant=no_depth, kind="none", record=record),
        "gradnorm": lambda d, record: M.train_gradnorm(d, plant=no_depth, record=record),
        "uncertainty": lambda d, record: M.train_weighted(d, M.UncertaintyLoss(),
                                                          plant=no_depth, record=record),
    }[run]
    recorded = train(tmp_path, True)
    plain = train(tmp_path, False)
    assert not list(tmp_path.glob("*.nan"))
    same_weights(recorded, plain)
    assert all(torch.isfinite(p).all() for p in recorded.parameters())


def test_a_scene_label_on_a_masked_class_names_its_record(tmp_path):
    """The scene head masks the class this dataset does not label with ``-inf`` (allowed),
    but record 5's label at step K is that class (a label map from another dataset's
    taxonomy): its cross-entropy is +inf. Named at the loss's nll_loss on sample 5, with the
    target on a masked class in the hint."""
    def foreign_label(step, x, seg, depth, scene):
        if step == K:
            scene[5] = 2
    crit = M.MultiTaskLoss(depth_loss=M.depth_l1_guarded)
    ev, bundle = fire(M.train_weighted, tmp_path, crit, plant=foreign_label)
    assert (ev["step"], ev["phase"], ev["kind"]) == (K, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], o["samples"], rep["cause"]) == ("aten.nll_loss_forward", [5], "invalid"), rep
    assert o["source"] == line_of("F.cross_entropy(out[\"scene\"], scene)]"), o
    assert "a target on a masked class" in rep["hint"], rep["hint"]


def test_pcgrad_under_a_grad_scaler_whose_scale_collapses_on_nan_steps_says_so(tmp_path):
    """Under float16 autocast with a GradScaler, every other batch lacks depth and PCGrad's
    0/0 makes its shared gradients NaN: the scaler takes each for an overflow, skips the
    update and halves its scale, until the recorder's scale_collapse event. The replay names
    the loop's own gradients and out["depth"], and says the scaler skipped for a NaN, not an
    overflow, which no scale fixes; before, nothing told the skipped steps from overflows."""
    def every_other(step, x, seg, depth, scene):
        if step % 2:
            depth.zero_()
    ev, bundle = fire(M.train_pcgrad, tmp_path, steps=40, plant=every_other, amp=True)
    assert (ev["reason"], ev["kind"], ev["step"] % 2) == ("scale_collapse", "scale", 1), ev
    rep = nanreplay_json(bundle, code=1)
    hint = rep["hint"]
    assert rep["cause"] == "not_reproduced", rep
    assert "written by the loop's own code" in hint, hint
    assert "model's output out[\"depth\"] was exactly 0 in every element" in hint, hint
    assert "the GradScaler skipped this step for gradients that are NaN" in hint, hint
    assert "no scale makes a 0/0 finite" in hint, hint


def test_a_batch_with_no_scene_label_names_the_empty_cross_entropy(tmp_path):
    """Mixed datasets: records without a scene label carry -1 and the scene loss runs over
    ``logits[has]``; step K's batch comes wholly from the dataset without scene labels, the
    selection is empty and cross_entropy's mean of no record is 0/0. Named at that
    nll_loss on its line, with 'skip such batches' in the hint."""
    def unlabelled(step, x, seg, depth, scene):
        scene[::3] = -1
        if step == K:
            scene.fill_(-1)
    crit = M.PartialLabelLoss(depth_loss=M.depth_l1_guarded)
    ev, bundle = fire(M.train_weighted, tmp_path, crit, plant=unlabelled)
    assert (ev["step"], ev["phase"], ev["kind"]) == (K, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["op"], rep["cause"]) == ("aten.nll_loss_forward", "invalid"), rep
    assert o["source"] == line_of("F.cross_entropy(out[\"scene\"][has], scene[has])]"), o
    assert "of an empty tensor" in rep["hint"] and "skip such batches" in rep["hint"], rep


def test_silog_over_a_relu_depth_head_names_the_log_of_zero_and_its_records(tmp_path):
    """A BTS-style depth head ending in ReLU under the scale-invariant log loss: the head
    predicts exactly 0 at some valid pixels from the first step, log(0) = -inf (then inf - inf
    in the variance term). Named at the log on its line, on the records holding such a pixel
    (counted here on an unrecorded forward), with the clamp in the hint."""
    model = M.make_relu_depth()
    crit = M.MultiTaskLoss(depth_loss=M.silog)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, seg, depth, scene = next(M.batches(1))
    with torch.no_grad():
        pred = M.make_relu_depth()(x)["depth"]
    rows = ((pred == 0) & (depth > 0)).flatten(1).any(1).nonzero().flatten().tolist()
    with pytest.raises(NonFiniteError) as info:
        rec = M.recorder(model, opt, tmp_path, "make_relu_depth", loss_fn=crit).attach()
        try:
            for x, seg, depth, scene in M.batches(4):
                opt.zero_grad()
                rec.loss_fn(model(x), seg, depth, scene % 2).backward()
                opt.step()
        finally:
            rec.detach()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "loss", "nan"), ev  # (inf - inf)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["made"], o["samples"], rep["cause"]) == (
        "aten.log", "-inf", rows, "invalid"), rep
    assert o["source"] == line_of("d = torch.log(pred[valid]) - torch.log(gt[valid])"), o
    assert "clamp the op's input away from the pole" in rep["hint"], rep["hint"]
