"""End to end on hand-written neural fields (``neural_fields_models``): an SDF on a
multiresolution hash grid whose forward takes its own gradient with ``autograd.grad``
(``create_graph=True``) for IGR's normal and eikonal terms, SIREN fitting an image from its
gradients (Poisson), Gaussian Fourier features under fp16 autocast, and an occupancy network
drawing near-surface points from its own ``torch.Generator``. Each planted bug of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_fields_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_fields_models.py", text)


def step_loss(kind: str, model, loss_fn, g: torch.Generator, bad: int | None, amp: bool):
    """One step's loss, as each repo's training loop computes it."""
    if kind == "sdf":
        x, gt, normals, on = M.sphere_batch(g, bad)
        sdf, grad = model(x)
        return loss_fn(sdf, grad, gt, normals, on)
    if kind == "siren":
        x, img_grad = M.image_grad_batch(g, bad)
        out, grad = model(x)
        return loss_fn(out, grad, img_grad)
    if kind == "occupancy":
        x, occ = M.occupancy_batch(g, bad)
        return loss_fn(model(x), occ)
    x, rgb = M.pixel_batch(g, bad)
    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
        pred = model(x)
    return loss_fn(pred.float(), rgb)


def train(kind: str, make: str, loss, out_dir, bad: int | None = None, steps: int = 4,
          record: bool = True, amp: bool = False):
    """Adam with an exponential decay and gradient clipping (IGR, SIREN and Instant-NGP's
    recipes); the sample ``bad`` is planted in the last step's batch. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir,
                         factory=f"neural_fields_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for step in range(steps):
            out = step_loss(kind, model, loss_fn, g, bad if step == steps - 1 else None, amp)
            opt.zero_grad()
            out.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, loss, tmp_path, bad: int, amp: bool = False):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, loss, tmp_path, bad, amp=amp)
    return info.value.event, info.value.bundle_path


def test_normals_of_a_flat_field_name_the_division_and_the_point(tmp_path):
    """A point sampled outside the hash grid's box reads the box's faces (the clamp), so the
    field is flat there and its gradient exactly 0: IGR's normals ``grad / |grad|`` are 0/0.
    A loss event; the replay names the division on its line, point 20 only, and an eps."""
    ev, bundle = fire("sdf", "make_hash_sdf", M.sdf_loss, tmp_path, bad=20)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "<loss>", "aten.div", "nan", [20]), o
    assert o["source"] == line_of("normals = grad / grad_norm[:, None]"), o
    assert rep["cause"] == "invalid" and "0 by 0" in rep["hint"] and "eps" in rep["hint"], rep


def test_normals_of_a_zero_initialised_head_name_the_layer_not_only_an_eps(tmp_path):
    """The SDF's last layer zero-initialised: the field is constant, its gradient 0 at every
    point, and the normals are 0/0 in every sample at step 0. An eps would keep every normal
    0; the replay names the division, every row, and the zero weight, found by a re-run with
    it filled with random values."""
    with pytest.raises(NonFiniteError) as info:
        train("sdf", "make_hash_sdf_zero_head", M.sdf_loss, tmp_path)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["all_samples"]) == ("aten.div", True), o
    assert o["source"] == line_of("normals = grad / grad_norm[:, None]"), o
    assert rep["cause"] == "invalid" and "parameter net.4.weight, all 0" in rep["hint"], rep
    assert "initialise that layer with small random values" in rep["hint"], rep["hint"]


def test_hand_written_cosine_masked_by_a_product_names_the_mask_too(tmp_path):
    """The normal term's cosine written out: the off-surface points carry zero target
    normals, their cosine is 0/0, and the surface mask applied by a product keeps the NaN.
    The replay names the division, exactly the 16 off-surface rows, and adds that the mask's
    product kept it, naming its line and ``torch.where`` / selecting the entries before it."""
    with pytest.raises(NonFiniteError) as info:
        train("sdf", "make_hash_sdf", M.cosine_sdf_loss, tmp_path)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["op"], o["samples"]) == ("aten.div", list(range(16, 32))), o
    assert o["source"] == line_of("cos = (grad * gt_normals).sum(-1) / (grad.norm(dim=-1)"), o
    hint = rep["hint"]
    assert rep["cause"] == "invalid" and "0 by 0" in hint, hint
    assert f"then aten.mul ({line_of('normal_term = (surf * (1 - cos))')})" in hint, hint
    assert "torch.where(valid, t, 1)" in hint and "nothing is to drop" in hint, hint


def test_eikonal_sqrt_at_a_zero_gradient_names_sqrt_backward_and_vector_norm(tmp_path):
    """The normals by F.normalize (its eps), but the eikonal's ``|grad|`` written as
    ``sqrt(sum(g^2))``: its backward divides by 2 sqrt(0) at the flat point. A backward event
    on the gradient entering the model's ``grad`` output; the replay names SqrtBackward0 in
    the loss, its line, point 20, and ``torch.linalg.vector_norm`` as the fix."""
    ev, bundle = fire("sdf", "make_hash_sdf", M.eikonal_loss, tmp_path, bad=20)
    assert (ev["step"], ev["phase"], ev["samples"]) == (3, "backward", [20]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == (
        "backward", "<loss>", "SqrtBackward0", [20]), o
    assert o["source"] == line_of("gnorm = grad.pow(2).sum(-1).sqrt()"), o
    assert rep["cause"] == "invalid" and "vector_norm" in rep["hint"], rep["hint"]


def test_fp16_fourier_features_of_unnormalised_coordinates_name_the_projection(tmp_path):
    """One tile's coordinates left in (supersampled) pixels: under fp16 autocast the Gaussian
    projection ``2 pi x B`` (scale 10) passes 65504, and sin(inf) is NaN. The replay names the
    matmul in ``encoding``, the chain to the sin, record 9, overflow, and the record's
    out-of-scale data rather than float32 alone; dropping it makes the step finite."""
    ev, bundle = fire("fourier", "make_fourier", torch.nn.MSELoss(), tmp_path, bad=9, amp=True)
    assert (ev["step"], ev["module"], ev["samples"]) == (3, "encoding", [9]), ev
    rep = nanreplay_json(bundle, "--try", "drop=9")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "encoding", "aten.mm", "+inf", [9]), o
    assert o["source"] == line_of("proj = 2 * math.pi * x @ self.B"), o
    assert [c["op"] for c in o["chain"]] == ["aten.mm", "aten.sin"], o["chain"]
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_occupancy_bce_by_hand_names_the_log_and_the_point_behind_its_near_copy(tmp_path):
    """The occupancy net evaluates each point and a point drawn near it, ``cat([x, near])``:
    its logits have twice the batch's rows. One point left in the scanner's units saturates
    the sigmoid to 1.0, and the hand-written BCE's ``log(1 - p)`` is -inf. The loss re-run
    alone could not tell which record rows 8 and 40 are (it named none); the replay now
    follows the samples through the forward's cat and names record 8, the log on its line,
    and ``logsigmoid(-z)`` as the fix; dropping the record makes the step finite."""
    ev, bundle = fire("occupancy", "make_occupancy", M.occupancy_bce, tmp_path, bad=8)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=8")
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == ("<loss>", "aten.log", "-inf", [8]), o
    assert o["source"] == line_of("return -(y * torch.log(p) + (1 - y) * torch.log(1 - p))"), o
    assert rep["cause"] == "precision" and "logsigmoid(−z)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


@pytest.mark.parametrize("kind,make,loss", [
    ("sdf", "make_hash_sdf", M.safe_sdf_loss), ("siren", "make_siren_poisson", M.poisson_loss),
    ("occupancy", "make_occupancy", M.occupancy_bce)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, loss):
    """The fixed SDF loss (vector_norm, cosine_similarity) on the same flat point, SIREN's
    Poisson fit (a second-order backward through sin layers every step) and the occupancy
    net drawing from its own generator: no event, bit-identical weights with and without
    the recorder."""
    bad = 20 if kind == "sdf" else None
    recorded = train(kind, make, loss, tmp_path, bad)
    plain = train(kind, make, loss, tmp_path, bad, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_scaled(out_dir, record: bool = True, steps: int = 5):
    """The Fourier field under fp16 autocast with a GradScaler whose first scale (2^40)
    overflows the fp16 gradients of every step here: each update is skipped and the scale
    halved, as AMP does; unscale_ before clipping. Returns (model, the scales seen)."""
    model, loss = M.make_fourier(), torch.nn.MSELoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    g, scales = torch.Generator().manual_seed(0), []
    rec = FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, scaler=scaler,
                         factory="neural_fields_models:make_fourier") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else loss
        for _ in range(steps):
            x, rgb = M.pixel_batch(g, None)
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
            opt.zero_grad()
            scaler.scale(loss_fn(pred.float(), rgb)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return model, scales


def test_grad_scaler_skipping_overflowed_fp16_steps_is_no_event(tmp_path):
    """Inf gradients the GradScaler finds and skips are AMP working, not a NaN to stop on:
    no bundle, the same halved scales and bit-identical weights with and without the
    recorder."""
    recorded, scales = train_scaled(tmp_path)
    plain, plain_scales = train_scaled(tmp_path, record=False)
    assert scales == plain_scales and scales[0] == 2.0 ** 39, scales
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
