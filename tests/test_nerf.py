"""Neural radiance fields trained as nerf-pytorch and BARF write them: stratified samples and
hierarchical samples drawn with ``torch.rand`` inside the forward, alpha compositing, inverse
transform sampling over ``torch.searchsorted``, and camera rotations learnt through Rodrigues'
formula. Each planted bug is named by module, op, samples and cause, with the rows told apart
by recomputing them here, not by the replay."""

from __future__ import annotations

import json
from pathlib import Path

import nerf_models as N
import pytest
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(code: str) -> int:
    """The line of nerf_models.py holding ``code`` (once)."""
    lines = (HERE / "nerf_models.py").read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, 1) if code in text]
    return n


def test_a_pdf_of_a_ray_that_sees_nothing_is_named_with_its_rays(tmp_path):
    """``sample_pdf`` without nerf-pytorch's ``weights + 1e-5``: a ray whose coarse densities
    are all 0 (ReLU of a density started below 0) has weights summing to 0, and its pdf is
    0/0. The replay re-draws the stratified depths (``torch.rand`` in the forward) and names
    the division in the renderer and exactly the rays whose weights were all 0."""
    torch.manual_seed(0)
    model = N.make_renderer_no_eps()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    crit = N.PhotometricLoss()
    loader = DataLoader(TensorDataset(*N.rays(2048, 0)), batch_size=256, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="nerf_models:make_renderer_no_eps"):
            for o, d, c in loader:
                rng = torch.get_rng_state()
                opt.zero_grad()
                crit(model(o, d), c).backward()
                opt.step()
    # the rays whose coarse weights are all 0, recomputed with the step's draw and weights
    torch.set_rng_state(rng)
    with torch.no_grad():
        b = o.shape[0]
        t = torch.linspace(N.NEAR, N.FAR, model.n_coarse).expand(b, model.n_coarse)
        mids = 0.5 * (t[..., 1:] + t[..., :-1])
        lower = torch.cat([t[..., :1], mids], -1)
        upper = torch.cat([mids, t[..., -1:]], -1)
        t = lower + (upper - lower) * torch.rand(b, model.n_coarse)
        sigma, rgb = model.coarse(o[:, None] + d[:, None] * t[..., None])
        weights, _ = N.composite(sigma, rgb, t, d)
    empty = torch.nonzero(weights[..., 1:-1].sum(-1) == 0).flatten().tolist()
    assert 0 < len(empty) < b, empty
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev  # (the first batch already)
    rep = nanreplay_json(info.value.bundle_path)
    o_ = rep["origin"]
    assert (o_["phase"], o_["module"], o_["op"], rep["cause"]) == \
        ("forward", "", "aten.div", "invalid"), json.dumps(rep, indent=1)
    assert o_["samples"] == empty, (o_["samples"], empty)
    assert o_["source"] == f"nerf_models.py:{line_of('pdf = weights / torch.sum(')}", o_
    assert rep["reproduced"] is True, rep


def test_rodrigues_guarded_by_where_at_zero_rotation_names_the_backward_division(tmp_path):
    """BARF-style pose refinement: per-camera axis-angle corrections, an ``nn.Embedding``
    started at zero and indexed by the batch's camera ids, turned into rotations by Rodrigues'
    formula whose small-angle case is a ``torch.where``. The forward is finite; backward sends
    the gradient through the untaken ``(1 - cos θ) / θ²`` branch, 0/0 at θ = 0. The event is
    the step's backward, named at that division with every ray (every camera starts at 0) and
    the where-trap hint."""
    torch.manual_seed(0)
    model = N.make_pose_refiner()
    opt = torch.optim.Adam([{"params": model.scene.parameters(), "lr": 5e-4},
                            {"params": model.poses.parameters(), "lr": 1e-3}])
    crit = N.PhotometricLoss()
    o, d, c = N.rays(256, 0)
    cam = torch.arange(256) % 8
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="nerf_models:make_pose_refiner"):
            for step in range(2):
                sl = slice(step * 128, step * 128 + 128)
                opt.zero_grad()
                crit(model(o[sl], d[sl], cam[sl]), c[sl]).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o_ = rep["origin"]
    assert (o_["phase"], o_["module"], o_["op"], rep["cause"]) == \
        ("backward", "", "DivBackward0", "invalid"), json.dumps(rep, indent=1)
    assert o_["samples"] == list(range(128)), o_["samples"]
    assert o_["source"] == f"nerf_models.py:{line_of('(1 - torch.cos(theta)) / theta')}", o_
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]
