"""End to end: 3D Gaussian splatting in pure PyTorch (``gaussian_splatting_models``: gsplat's
parameters and projection, 3DGS's covariance, SSIM + L1 loss and densification), trained under
the recorder from a DataLoader of cameras until a planted bug fires, then replayed with the
CLI. Densification swaps grown ``nn.Parameter``s into the module and the Adam between steps,
as 3DGS's ``cat_tensors_to_optimizer`` does: the recorder must follow them, and the replay
must rebuild the model with the run's number of Gaussians, not the factory's."""

from __future__ import annotations

import warnings
from pathlib import Path

import gaussian_splatting_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(code: str) -> int:
    """The line of gaussian_splatting_models.py holding ``code`` (once)."""
    lines = (HERE / "gaussian_splatting_models.py").read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, 1) if code in text]
    return n


def train(out_dir, factory: str, steps: int = 10, densify=None, in_step: bool = False,
          **recorder_kw):
    """gsplat's ``simple_trainer`` loop over a DataLoader of 2 cameras a batch; ``densify``:
    ``{step: (kind, idx)}`` run before that step ("clone", "clone_zero_quats", "prune",
    "relocate_unclamped"), or with ``in_step`` inside it, between ``backward()`` and
    ``optimizer.step()`` as 3DGS's ``train.py`` does."""
    model = getattr(M, factory)()
    opt = M.make_optimizer(model)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    vm, K = M.cameras(8)
    img, dep = M.targets(vm, K)
    loader = DataLoader(TensorDataset(vm, K, img, dep), batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    batches = (b for _ in range(steps) for b in loader)
    with FlightRecorder(model, opt, loss_fn=M.splat_loss, out_dir=out_dir, lr_scheduler=sched,
                        factory=f"gaussian_splatting_models:{factory}", **recorder_kw) as rec:
        for step in range(steps):
            if not in_step:
                _densify(model, opt, (densify or {}).get(step))
            v, k, i, d = next(batches)
            loss = rec.loss_fn(model(v, k), i, d)
            opt.zero_grad()
            loss.backward()
            if in_step:
                _densify(model, opt, (densify or {}).get(step))
            opt.step()
            sched.step()
    return model


def _densify(model, opt, what) -> None:
    kind, idx = what or (None, None)
    if kind == "prune":
        M.prune_points(model, opt, idx)
    elif kind == "relocate_unclamped":  # (the dead first, then the alive they join)
        M.relocate(model, opt, torch.tensor(idx[0]), torch.tensor(idx[1]), clamp=False)
    elif kind is not None:
        M.densify_clone(model, opt, torch.tensor(idx), fresh_quats=kind == "clone_zero_quats")


@pytest.mark.parametrize("in_step", [False, True], ids=["between-steps", "3dgs-order"])
def test_densified_gaussians_with_zero_quaternions_are_replayed_with_the_runs_gaussians(
        tmp_path, in_step):
    """Clones whose quaternions were made as ``torch.zeros((N, 4))`` (the ``rots[:, 0] = 1``
    forgotten): ``build_rotation``'s ``r / norm`` is 0/0 in their rows. The recorder used to
    keep checking and bundling the parameters it saw at attach (24 Gaussians), so the replay
    ran the stale ones and the event did NOT come back; the replay refused a bundle of 27.
    In 3DGS's order the clones join after step 4's backward, so step 5's forward fails."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats", densify={4: ("clone_zero_quats", [2, 5, 7])},
              in_step=in_step)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (5 if in_step else 4, "forward", ""), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"]) == (
        True, "invalid", "", "aten.div", "nan"), rep
    assert o["source"] == f"gaussian_splatting_models.py:{line_of('q = r / norm[:, None]')}"
    assert o["samples"] == [0, 1] and o["all_samples"], o  # (every camera sees the clones)
    assert "0 by 0" in rep["hint"], rep["hint"]
    assert any("replaced by the training loop" in p and "[27, 3]" in p
               for p in rep["problems"]), rep["problems"]


def test_healthy_densify_and_prune_run_raises_no_event_and_no_warning(tmp_path, caplog):
    """The same loop, its Gaussians cloned (3DGS's way) and pruned between steps: nothing
    fires, nothing is written, nothing is logged (as unknown parameters) or warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level("WARNING", logger="nanreplay"):
            model = train(tmp_path, "make_splats", steps=12, in_step=True,
                          densify={3: ("clone", [2, 5, 7]), 7: ("prune", [0, 1, 26])})
    assert model.splats["means"].shape == (24, 3)
    assert list(tmp_path.iterdir()) == [] and caplog.records == [], caplog.text


def test_expected_depth_without_eps_names_the_cameras_with_empty_pixels(tmp_path):
    """gsplat's expected depth ``sum(w z) / sum(w)`` without its ``clamp_min(1e-10)``: a pixel
    no Gaussian reaches (alpha under 1/255 everywhere, as the CUDA kernel drops) is 0/0. The
    samples are the batch's cameras with such a pixel, recomputed here from the bundle."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats_depth_no_eps")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "forward", ""), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["module"], o["op"]) == (
        True, "invalid", "forward", "", "aten.div"), rep
    assert o["source"] == f"gaussian_splatting_models.py:{line_of('depth = (w * depths')}"
    # the cameras of the event's batch with a pixel no Gaussian reaches (its accumulated
    # alpha exactly 0), rendered here from the bundle's weights and batch, outside the replay
    from recorder.bundle import read_bundle
    _, t = read_bundle(info.value.bundle_path)
    model = M.make_splats()
    model.load_state_dict({k.removeprefix("weights/"): v for k, v in t.items()
                           if k.startswith("weights/")})
    vm, K = t["batch/0/0"], t["batch/0/1"]
    with torch.no_grad():
        model.depth_eps = 0.0
        _, depth = model(vm, K)
    empty = [c for c in range(vm.shape[0]) if bool(torch.isnan(depth[c]).any())]
    assert 0 < len(empty) < vm.shape[0] and ev["samples"] == empty, (empty, ev)
    assert o["samples"] == empty, o
    assert "add an eps to the denominator" in rep["hint"], rep["hint"]


def test_log_scales_of_duplicate_points_name_the_factorys_log_not_a_mask(tmp_path):
    """3DGS's initial scales without ``clamp_min(dist2, 1e-7)``, over a cloud where COLMAP
    wrote a point 4 times: their nearest distance is 0 and ``log(sqrt(0))`` is -inf in the
    trained ``scales``. The weights hint used to read the -inf as an intended mask ("keep a
    boolean mask in a buffer"); it now names the factory's op and line that made it."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats_duplicates_no_floor")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "weights", ["splats.scales"]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["param"]) == (
        True, "weights", "splats.scales"), rep
    line = line_of("return torch.log(torch.sqrt(dist2))")
    assert f"aten.log of 0 made -inf at gaussian_splatting_models.py:{line}" in rep["hint"], \
        rep["hint"]
    assert "mask in a buffer" not in rep["hint"], rep["hint"]
    assert "row(s) 0, 1, 2, 3 of 24" in rep["hint"], rep["hint"]


def test_relocation_logit_of_an_opacity_of_one_is_the_loops_write_not_the_optimizers(tmp_path):
    """gsplat's MCMC relocation without its clamp below 1: an alive Gaussian fully opaque
    (sigmoid(20) is 1.0 in float32) splits its opacity as ``1 - (1 - 1) ** 0.5 = 1``, whose
    logit is +inf, swapped in as the new ``opacities``. Its gradient is 0 (sigmoid saturated),
    so the update leaves +inf. Was: "optimizer.step() made splats.opacities non-finite",
    cause optimizer, NOT reproduced ("check the learning rate ... clip gradients")."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats_opaque", densify={4: ("relocate_unclamped",
                                                           ([0, 1], [3, 9]))})
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (
        4, "weights", ["splats.opacities"], "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["param"]) == (
        True, "weights", "splats.opacities"), rep
    assert "the training loop replaced splats.opacities" in rep["hint"], rep["hint"]
    assert "logit" in rep["hint"] and "learning rate" not in rep["hint"], rep["hint"]


def test_collapsed_splat_without_dilation_is_an_underflowed_determinant_not_a_log_space_fix(
        tmp_path):
    """gsplat's 0.3 dilation off and a Gaussian shrunk to log-scales -30: its 2-D covariance's
    determinant ``a * c - b * b`` is ~1.8e-51, 0 in float32, and the conic's ``c / det`` is
    +inf. The cause is underflow (float64 keeps it); the advice was the log-space list
    (log_softmax, a Cox loss, TRADES' KL), none of which a determinant has."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats_collapsed_no_dilation")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", ""), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["made"], o["samples"]) == (
        True, "underflow", "aten.div", "+inf", [0, 1]), rep
    assert o["source"] == f"gaussian_splatting_models.py:{line_of('conics = torch.stack([c / det')}"
    assert "dilated before its determinant" in rep["hint"], rep["hint"]
    assert "log_softmax" not in rep["hint"], rep["hint"]


def test_a_rewind_window_from_before_densification_is_not_re_run_as_evidence(tmp_path):
    """The zero-quaternion clones recorded with ``rewind=2``: the window's copy (step 2) holds
    24 Gaussians, the event step 27. Re-running the window cannot redo the loop's
    densification, and said "every value finite: the event did NOT come back" beside the
    reproduced step; the window is now not re-run, and the note says why."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats", densify={4: ("clone_zero_quats", [2, 5, 7])}, rewind=2)
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["op"]) == (
        True, "invalid", "aten.div"), rep
    assert rep["window"] is None, rep["window"]
    assert any("the rewind window was not re-run: the loop replaced splats." in p
               and "densification" in p for p in rep["problems"]), rep["problems"]


def test_a_sky_point_near_infinity_is_named_as_the_factorys_overflow_not_a_pole(tmp_path):
    """A point triangulated near infinity (3e19): ``cdist`` squares past float32 while the
    initial scales are computed, +inf in ``scales`` row 7. The factory's op is named, and the
    advice is the outlier's, not "clamp away from 0" (no pole was hit)."""
    with pytest.raises(NonFiniteError) as info:
        train(tmp_path, "make_splats_far_outlier")
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (
        0, "weights", ["splats.scales"], "+inf"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["param"]) == (
        True, "weights", "splats.scales"), rep
    line = line_of("d2 = torch.cdist(points, points)")
    assert f"aten._cdist_forward made +inf at gaussian_splatting_models.py:{line}" in \
        rep["hint"], rep["hint"]
    assert "too large for the type" in rep["hint"] and "away from 0" not in rep["hint"], \
        rep["hint"]
    assert "row(s) 7 of 24" in rep["hint"], rep["hint"]
