"""Dense regression and image restoration trained as those repos write it
(``dense_regression_models.py``): optical flow with multi-scale end-point-error losses over
sparse ground truth (one returning a dict of terms the loop sums), super-resolution with
Charbonnier (in float16) and perceptual losses through a frozen feature extractor in eval mode,
monocular depth with monodepth2's tuple-keyed dicts, a frozen-BatchNorm encoder and gradient
matching on log depth; with a planted bug, the recorder fires at the planted step and
``nanreplay --json`` names the op, samples, cause and fix."""

from __future__ import annotations

import copy
import inspect
import json

import dense_regression_models as D
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, model, opt, crit, batches, factory, **kw):
    """The loop under the recorder; returns its error."""
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw):
            for x, *targets in batches:
                opt.zero_grad()
                crit(model(x), *targets).backward()
                opt.step()
    return info.value


def _line_of(text: str, within=D) -> str:
    """``dense_regression_models.py:N`` of the line holding ``text`` (in ``within``'s code)."""
    lines, first = inspect.getsourcelines(within)
    [n] = [i for i, line in enumerate(lines, max(first, 1)) if text in line]
    return f"dense_regression_models.py:{n}"


def _pairs(*tensors, bs: int = 2):
    n = len(tensors[0])
    return [tuple(t[i:i + bs] for t in tensors) for i in range(0, n, bs)]


@pytest.mark.parametrize("loss_cls", ["CharbonnierPerceptual", "PlainPerceptual"])
def test_a_perceptual_loss_s_frozen_extractor_is_rebuilt_in_eval_mode_and_widened(
        out_dir, loss_cls):
    """ESRGAN-style super-resolution: EDSR with pixel-shuffle, Charbonnier plus a perceptual
    term on unit-normalised features of a frozen extractor (Conv - BatchNorm - ReLU, in eval
    mode) that the loss module holds, the normalisation written without LPIPS's eps. A pixel
    of an HR crop where every feature is 0 makes 0/0. The float64 re-run widened the model
    and the loss's buffers but not the loss's own (frozen) parameters, so the extractor's
    convolution refused float64 input and the cause was 'unknown'; it is 'invalid' now. A
    loss that puts its extractor in eval mode in ``__init__`` (no ``train()`` override) was
    rebuilt with the loss's ``train(True)``, which put the extractor's BatchNorm back in
    training mode: the report named the SR features' line (``fs``) on every row; each
    submodule is rebuilt in its own recorded mode now."""
    lr, hr = D.sr_pairs(8)
    crit = getattr(D, loss_cls)()
    assert crit.training and not crit.vgg.training
    with torch.no_grad():
        dead = ((crit.vgg(hr) ** 2).sum(1) == 0).flatten(1).any(1)
    step = int(dead.nonzero()[0]) // 2
    samples = dead[2 * step:2 * step + 2].nonzero()[:, 0].tolist()
    assert (step, samples) == (1, [0])
    model = D.make_edsr()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    err = _train(out_dir, model, opt, crit, _pairs(lr, hr), "dense_regression_models:make_edsr")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (step, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", samples, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("fh = fh / torch.sqrt", D.PlainPerceptual), o["source"]
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]
    assert crit.vgg.features[0].weight.dtype == torch.float32
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=0", True)], \
        rep["what_if"]


def test_monodepth2_s_dicts_keyed_by_tuples_are_rebuilt_and_the_unnormalised_frame_named(
        out_dir):
    """monodepth2 keys its inputs and outputs by tuples (``inputs[("color", 0, 0)]``,
    ``outputs[("disp", s)]``). One frame was read from a 16-bit PNG and never divided by
    65535: its sigmoid disparity rounds to 0 and ``depth = 1 / disp`` is inf. The replay
    failed outright ('UnrebuildableLeaf: dict key ('disp', 0)'): the bundle kept a tuple
    key as its repr. Tuples of JSON scalars are kept as tuples now, and the report names
    the reciprocal, the frame and the underflow."""
    imgs, depth = D.depth_scenes(8)
    imgs[5] = imgs[5] * 65535
    batches = [{("color", 0, 0): imgs[i:i + 2], "depth_gt": depth[i:i + 2]}
               for i in range(0, 8, 2)]
    model = D.make_monodepth()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = D.DispToDepthL1()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="dense_regression_models:make_monodepth"):
            for inputs in batches:
                opt.zero_grad()
                crit(model(inputs), inputs["depth_gt"]).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    frames = batches[2][("color", 0, 0)]
    samples = (frames.flatten(1).abs().amax(1) > 1000).nonzero()[:, 0].tolist()
    assert samples == [1]
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.reciprocal", "+inf", samples, "underflow"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("depth = 1 / disp"), o["source"]
    assert "out of scale" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=1", True)], \
        rep["what_if"]


def test_basicsr_s_charbonnier_eps_lost_in_float16_is_said_at_the_sqrt_backward(out_dir):
    """BasicSR's ``CharbonnierLoss``, ``sqrt((pred - target) ** 2 + 1e-12)``, on an EDSR
    trained in float16 (``model.half()``, half crops). Where an output pixel equals its target
    exactly, float16 rounds 0 + 1e-12 to 0, and sqrt's backward is inf there (times the
    square's 0: NaN). The report named SqrtBackward0 and told the user to put an eps under
    the root, which the loss already does; it says now that 1e-12 is 0 in float16 (as it
    did for a forward op's lost eps only)."""
    lr, hr = D.sr_pairs(64, size=16)
    batches = _pairs(lr.half(), hr.half())
    model = D.make_edsr().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-4)
    crit = D.CharbonnierLoss()
    seen = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="dense_regression_models:make_edsr"):
            for x, y in batches:
                opt.zero_grad()
                out = model(x)
                seen.append((out.detach(), y))
                crit(out, y).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    out, y = seen[-1]
    exact = (out == y).flatten(1).any(1).nonzero()[:, 0].tolist()
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "SqrtBackward0", exact, "precision"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("torch.sqrt((pred - target) ** 2 + self.eps)"), o["source"]
    assert "the eps 1e-12 added to that input is 0 in float16" in rep["hint"], rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("dtype=float32", True)], \
        rep["what_if"]


def test_a_perceptual_net_the_loss_shares_with_the_model_is_the_rebuilt_model_s(out_dir):
    """The SR model carries its frozen perceptual network (``model.vgg``, eval mode, with an
    LPIPS-style unit normalisation layer without eps) and the loss is given that same module,
    ``PerceptualThrough(model.vgg)``. The recorder's hooks see the loss's calls of it: a
    forward event in ``vgg.features.5``, call 1 (the HR crop's features). The replay rebuilt
    the loss with a copy of the network, whose calls no hook saw, and the loss module's
    ``train()`` put nothing back: 'NOT reproduced'. The loss now gets the rebuilt model's
    own module, in its recorded mode, and the report names the call and its image."""
    lr, hr = D.sr_pairs(8)
    model = D.make_sr_with_loss_net()
    model.train()
    with torch.no_grad():
        feats = model.vgg.features[:-1](hr[2:4])  # (frozen: as at step 1)
    samples = ((feats ** 2).sum(1) == 0).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert samples == [0]
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    err = _train(out_dir, model, opt, D.PerceptualThrough(model.vgg), _pairs(lr, hr),
                 "dense_regression_models:make_sr_with_loss_net")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["call"]) == \
        (1, "forward", "vgg.features.5", 1), ev
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["call"], o["op"], o["samples"], rep["cause"]) == \
        (True, "vgg.features.5", 1, "aten.div", samples, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("return f / torch.sqrt((f ** 2)"), o["source"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=0", True)], \
        rep["what_if"]


def test_a_loss_returning_a_dict_of_terms_the_loop_sums_is_differentiated_in_the_replay(
        out_dir):
    """mmflow-style: the loss returns ``{"loss_flow_0": ..., "loss_flow_1": ...}`` and the
    loop backpropagates ``sum(losses.values())``. KITTI-like sparse ground truth in image 5:
    the EPE written with the valid map multiplied in before the square root is sqrt(0) at its
    holes, whose backward is inf (times the square's 0: NaN). The replay differentiated
    nothing of a dict of several terms, found the loss's gradients finite and blamed 'loss
    terms computed outside loss_fn' (cause unknown); it backpropagates the terms' sum now
    (those named ``loss...``, as mmcv's ``parse_losses`` sums them) and names the sqrt."""
    frames, gt, valid = D.flow_pairs(8, holes=0.0)
    valid[5] = torch.rand(16, 16, generator=torch.Generator().manual_seed(3)) > 0.5
    model = D.make_flownet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = D.DictEPE()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="dense_regression_models:make_flownet"):
            for x, y, v in _pairs(frames, gt, valid):
                opt.zero_grad()
                losses = crit(model(x), y, v)
                sum(losses.values()).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    holes = (~valid[4:6]).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert holes == [1]
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("backward", "<loss>", "SqrtBackward0", holes, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("epe = (((flow - target) * v) ** 2)"), o["source"]
    assert "outside" not in rep["hint"] and "vector_norm" in rep["hint"], rep["hint"]
    [what_if] = rep["what_if"]  # (its loss: the terms' sum, as the loop's)
    assert (what_if["try"], what_if["finite"]) == ("drop=1", True), what_if
    assert what_if["loss"] is not None and what_if["loss"] > 0, what_if


def test_a_loss_s_weights_keyed_by_stride_are_replayed_as_the_run_set_them(out_dir):
    """Multi-scale EPE with its scale weights in a dict keyed by stride, ``{2: 1.0, 4: 0.5}``
    (the class's default is ``{2: 0.32, 4: 0.08}``). Image 5's ground truth has no valid
    pixel in its top half, so a coarse window's flow target is 0/0. A dict with int keys is
    no JSON object: the bundle listed it as unrecorded and the replay, building the loss with
    its defaults, kept them without a word; the what-if's loss was the defaults'. It is kept
    as its pairs now: the what-if dropping image 5 computes the run's loss of image 4."""
    frames, gt, valid = D.flow_pairs(8, holes=0.0)
    valid[5, :8] = False
    model = D.make_flownet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = D.StrideWeightedEPE({2: 1.0, 4: 0.5})
    starts = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="dense_regression_models:make_flownet"):
            for x, y, v in _pairs(frames, gt, valid):
                starts.append(copy.deepcopy(model))
                opt.zero_grad()
                crit(model(x), y, v).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    empty = [i for i in range(2) if not valid[4 + i, :8].any()]
    assert empty == [1]
    with torch.no_grad():  # the step without image 5, with the run's weights
        expected = float(crit(starts[2](frames[4:5]), gt[4:5], valid[4:5]))
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", empty, "invalid"), json.dumps(rep, indent=1)
    [what_if] = rep["what_if"]
    assert (what_if["try"], what_if["finite"]) == ("drop=1", True), what_if
    assert what_if["loss"] == pytest.approx(expected, rel=1e-4), (what_if, expected)


def test_a_frozen_bn_encoder_and_a_loss_attribute_the_bundle_cannot_store(out_dir):
    """BTS-style: a "pretrained" encoder whose BatchNorms the loop freezes after
    ``model.train()`` (``freeze_bn``), a ReLU depth head, MegaDepth's gradient-matching loss
    on log depth. Image 5's dark corner drives the frozen-BN encoder's depth to 0 (not with
    batch statistics: the re-run must keep the recorded eval modes): log(0) = -inf, named at
    the loss's log on image 5. The loss keeps a ``torch.device`` attribute, which the bundle
    cannot store: the replay used the value the class's default construction gives without a
    word; it says so now in a note."""
    imgs, depth = D.depth_scenes(8)
    imgs[5, :, :4, :4] = -50.0
    model = D.make_bts()
    model.train()
    model.freeze_bn()
    with torch.no_grad():
        zero = (model(imgs[4:6]) == 0).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert zero == [1]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = D.LogGradientMatching(device=torch.device("cpu"))
    err = _train(out_dir, model, opt, crit, _pairs(imgs, depth), "dense_regression_models:make_bts")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (2, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.log", "-inf", zero, "invalid"), json.dumps(rep, indent=1)
    assert any("attribute(s) device (device) could not be stored" in p for p in rep["problems"]), \
        rep["problems"]


@pytest.mark.parametrize("loss_cls", ["HookPerceptual", "TappedPerceptual"])
def test_a_perceptual_loss_tapping_its_extractor_with_forward_hooks_is_replayed(out_dir,
                                                                               loss_cls):
    """A perceptual loss that reads its extractor's layers through forward hooks it registers
    in ``__init__`` (``self.feats[i] = out``). The replay built the loss's class, then put
    freshly built copies of its submodules in place of the ones its constructor had hooked:
    no hook filled ``self.feats`` and the replay failed outright (KeyError: 2); a class whose
    constructor needs its ``layers`` was not constructed at all. The submodules are rebuilt
    into the ones the constructor made now, and a constructor is called with the recorded
    attributes that bear its arguments' names: the 0/0 of the HR crop's unit-normalised
    features is named, on its image."""
    lr, hr = D.sr_pairs(8)
    crit = getattr(D, loss_cls)(layers=(2, 5))
    with torch.no_grad():
        feats = crit.vgg.features[:-1](hr[2:4])
    samples = ((feats ** 2).sum(1) == 0).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert samples == [0]
    model = D.make_edsr()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    err = _train(out_dir, model, opt, crit, _pairs(lr, hr), "dense_regression_models:make_edsr")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"]) == (1, "loss", "<loss>"), ev
    rep = nanreplay_json(err.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == \
        ("<loss>", "aten.div", "nan", samples, "invalid"), json.dumps(rep, indent=1)
    assert o["source"] == _line_of("return f / torch.sqrt((f ** 2)"), o["source"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("drop=0", True)], \
        rep["what_if"]
