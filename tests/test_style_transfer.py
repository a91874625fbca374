"""End to end: input optimisation (``style_transfer_models``: the neural style tutorial's
net with its losses kept aside on modules, fast_neural_style's ``Vgg16`` with a Gram/TV loss
function, DeepDream's normalised ascent), a frozen feature extractor and the IMAGE as the only
trained tensor, run under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

import pytest
import style_transfer_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("style_transfer_models.py", text)


def tutorial(out_dir, factory: str, *, lbfgs: bool, half: bool = False, steps: int = 3,
             high: float = 1.0):
    """The tutorial's loop: the losses the net keeps aside summed by the loop, the image
    clamped in place under no_grad each step; LBFGS with a closure, or Adam."""
    model = getattr(M, factory)()
    img = model.image
    opt = torch.optim.LBFGS([img], max_iter=4) if lbfgs else torch.optim.Adam([img], lr=0.05)
    style, content, tv = M.tutorial_losses(model)
    with FlightRecorder(model, opt, out_dir=out_dir,
                        factory=f"style_transfer_models:{factory}") as rec:
        for _ in range(steps):
            def closure():
                with torch.no_grad():
                    img.clamp_(0, high)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                    model()
                    loss = (1e5 * sum(m.loss for m in style) + sum(m.loss for m in content)
                            + sum(m.loss for m in tv))
                loss.backward()
                return loss
            opt.step(closure) if lbfgs else (closure(), opt.step())
    return rec


def fast_style(out_dir, loss_fn, steps: int = 4, rewind: int | None = None):
    """fast_neural_style's losses as a loss function given the features, the targets and the
    image parameter itself (its TV prior), Adam over the image."""
    model = M.make_fast_style()
    content_target, style_grams = M.style_targets(model.net)
    opt = torch.optim.Adam([model.image], lr=0.02)
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, rewind=rewind,
                        factory="style_transfer_models:make_fast_style") as rec:
        for _ in range(steps):
            opt.zero_grad()
            loss = rec.loss_fn(model(), content_target, style_grams, model.image)
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.image.clamp_(0, 1)
    return rec


def test_tv_sqrt_in_the_loss_given_the_image_parameter_is_named(tmp_path):
    # the content photo's white sky is flat: dx = dy = 0 there, and sqrt's gradient 1/(2*0)
    # times 2 * dx = 0 is NaN in the image's gradient at the first step
    with pytest.raises(NonFiniteError) as info:
        fast_style(tmp_path, M.style_transfer_loss, rewind=2)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["image"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    # (was: not_reproduced, "written by the loop's own code": the bundle held the image the
    # loss took as a copy, cut from the parameter, so the re-run had no path from the TV term)
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "backward", "<loss>", "SqrtBackward0", [0]), rep
    assert o["source"] == line_of("return torch.sqrt(dx ** 2 + dy ** 2).sum()")
    assert "sqrt(x + eps)" in rep["hint"] and "loop's own code" not in rep["hint"], rep["hint"]
    # the rewind window's re-run too (was: "every value finite: the event did NOT come back")
    w = rep["window"]
    assert (w["reproduced"], w["event_step"], w["first_non_finite"]["params"]) == (
        True, 0, ["image"]), w


def test_tv_module_kept_aside_under_lbfgs_is_named(tmp_path):
    # the tutorial's way: the TV term is a module of the net keeping self.loss, the loop sums
    # the kept losses and never uses the net's output, so no gradient reaches the output
    with pytest.raises(NonFiniteError) as info:
        tutorial(tmp_path, "make_style_model_tv", lbfgs=True)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["image"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    # (was: not_reproduced, "written by the loop's own code": the values kept aside were
    # backpropagated only when some gradient had reached the output)
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["samples"]) == (
        True, "invalid", "net.0", "SqrtBackward0", [0]), rep
    assert o["source"] == line_of("self.loss = self.strength * torch.sqrt(")
    assert "sqrt(x + eps)" in rep["hint"] and "loop's own code" not in rep["hint"], rep["hint"]
    assert any("no loss_fn was recorded" in p and "net.0.loss" in p
               for p in rep["problems"]), rep["problems"]


def test_gram_in_float16_over_caffe_range_pixels_is_the_mm_overflow(tmp_path):
    # Caffe VGG's 0..255 pixels under float16 autocast: F @ F.t() sums 256 squares of
    # activations in the tens to 7e5, beyond float16's 65504, before the division by C*H*W
    with pytest.raises(NonFiniteError) as info:
        tutorial(tmp_path, "make_style_model_caffe", lbfgs=False, half=True, high=255.0)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"]) == (
        True, "overflow", "net.style_loss_1", "MseLossBackward0"), rep
    assert (o["chain"][0]["op"], o["chain"][0]["dtype"]) == ("aten.mm", "float16"), o
    # the float16 mm's type, not the float32 loss's (was: dtype=float64), and a conclusive
    # re-run: the kept-aside losses are backpropagated in the what-if too (was: inconclusive)
    [t] = rep["what_if"]
    assert (t["try"], t["finite"], t["inconclusive"]) == ("dtype=float32", True, False), t
    assert o["source"] == line_of("self.loss = F.mse_loss(G, self.target)")
    h = rep["hint"]
    assert "aten.mm" in h and line_of("G = torch.mm(features, features.t())") in h, h
    assert "float16" in h and "float32" in h and "rescale its inputs" in h, h


@pytest.mark.parametrize("run", ["tutorial_lbfgs", "fast_style_tv_eps"])
def test_healthy_input_optimisation_raises_nothing(tmp_path, run):
    # LBFGS's closure evaluations (each a step) with the image clamped in place between them;
    # the TV prior with an eps under the sqrt, flat sky and all
    if run == "tutorial_lbfgs":
        rec = tutorial(tmp_path, "make_style_model", lbfgs=True)
        assert rec.step == 12
    else:
        rec = fast_style(tmp_path, M.style_transfer_loss_eps)
        assert rec.step == 4
    assert not list(tmp_path.glob("*.nan"))


def dream(out_dir, img: torch.Tensor, loss_fn, args, step_fn, steps: int = 3):
    """DeepDream / feature visualisation without an optimizer: the loop ascends the image."""
    model = M.make_dream_net()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, loss_fn=loss_fn, out_dir=out_dir,
                            factory="style_transfer_models:make_dream_net") as rec:
            for _ in range(steps):
                loss = rec.loss_fn(model(img), *args)
                loss.backward()
                step_fn(img)
                img.grad.zero_()
    return info.value


def test_deepdream_on_a_dead_channel_is_the_normalised_step_not_the_data(tmp_path):
    # the gray start leaves channel 3 of relu1_2 at 0 everywhere: loss 0, gradient exactly 0,
    # and google/deepdream's g / g.abs().mean() is 0/0 in every pixel
    def ascend(img):
        g = img.grad.data
        img.data += 0.01 * g / g.abs().mean()

    err = dream(tmp_path, M.gray_image().requires_grad_(True), M.dream_objective, (3,), ascend)
    assert (err.event["step"], err.event["phase"], err.event["tensor"]) == (1, "input", "batch")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["tensor"], o["samples"]) == ("input", "input", "batch",
                                                                     [0]), rep
    h = rep["hint"]
    # (was: "check the data pipeline for these samples (bad files, ...)")
    assert h.startswith("batch required grad in training: no record of data, then"), h
    assert "finite at step 0, whose loss was 0, exactly 0" in h, h
    assert "g.abs().mean().clamp_min(1e-8)" in h and "nn.Parameter" in h, h


def test_adam_over_a_leaf_image_recorded_without_it_names_the_update(tmp_path):
    # the recorder given optimizer=None (it refuses one that holds no parameter of the model):
    # Adam's update from the TV sqrt's NaN gradient, seen as the next step's input
    img = M.content_image().requires_grad_(True)
    opt = torch.optim.Adam([img], lr=0.02)
    model = M.make_vgg16()
    content_target, style_grams = M.style_targets(model)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, None, out_dir=tmp_path,
                            factory="style_transfer_models:make_vgg16"):
            for _ in range(3):
                opt.zero_grad()
                M.style_transfer_loss(model(img), content_target, style_grams, img).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (1, "input"), err.event
    # Adam's in-place update wrote the image after this step's forward too: not re-run (exit 1)
    rep = nanreplay_json(err.bundle_path, code=1)
    o, h = rep["origin"], rep["hint"]
    assert (rep["not_rerun"], o["phase"], o["tensor"], o["samples"]) == (
        "input written after the forward", "input", "batch", [0]), rep
    # (was: "a batch whose tensors view the dataset's storage ... write into a copy")
    assert "dataset" not in h and "a tensor the loop trains by its gradient" in h, h
    assert "finite at step 0:" in h and "sqrt(x + eps)" in h and "a loss of 0" not in h, h


def test_an_optimizer_over_the_input_image_is_refused_with_the_way_to_record_it(tmp_path):
    model, img = M.make_vgg16(), M.content_image().requires_grad_(True)
    with pytest.raises(ValueError) as info:
        FlightRecorder(model, torch.optim.LBFGS([img]), out_dir=tmp_path)
    msg = str(info.value)
    assert "1 optimizer parameter(s) are not parameters of the model" in msg, msg
    # (was: only "build the optimizer from this model's parameters()", which an image is not)
    assert "trains the model's input" in msg and "nn.Parameter" in msg, msg
    assert "optimizer=None" in msg, msg
