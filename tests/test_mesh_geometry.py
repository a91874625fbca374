"""End to end on differentiable mesh and point-cloud geometry (``mesh_geometry_models``): point
completion with PCN's square-rooted chamfer distance over ChamferDistancePytorch's expanded
``|x|² + |y|² − 2 x·y``, Pixel2Mesh-style template deformation regularised by pytorch3d's
cotangent Laplacian, face normals of batched meshes whose faces are padded with vertex 0, and
an IGR-style SDF trained with the eikonal term behind a bounding-box clamp. Each is trained
under the recorder until a planted bug of the domain fires, then replayed with the CLI; the
healthy versions train without an event."""

from __future__ import annotations

import mesh_geometry_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

FACTORY = "mesh_geometry_models:"


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("mesh_geometry_models.py", text)


def _origin(rep: dict) -> tuple:
    o = rep["origin"]
    return (rep["reproduced"], rep["event"]["step"], o["phase"], o["module"], o["op"],
            o["samples"], rep["cause"])


def train_completion(out_dir, loss_fn, steps: int = 4) -> list[float]:
    """PCN's loop: Adam with a step decay, complete clouds from a DataLoader of partial scans
    (a cropped subset of the complete cloud, as ShapeNet-part completion crops them)."""
    g = torch.Generator().manual_seed(0)
    data = [M.completion_batch(g) for _ in range(steps)]
    loader = torch.utils.data.DataLoader(
        [(p, c) for ps, cs in data for p, c in zip(ps, cs)], batch_size=4)
    model = M.make_completion()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    losses = []
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=FACTORY + "make_completion") as rec:
        for partial, gt in loader:
            loss = rec.loss_fn(model(partial), gt)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses


def train_deform(out_dir, loss_fn, sliver_at: int | None, steps: int = 4,
                 sgd: bool = False, on_template: bool = False) -> list[float]:
    """Pixel2Mesh's loop over shapes: a random shape code and target points per step, the
    template (or its copy with a collapsed face) deformed by the predicted offsets; Adam, or
    the pytorch3d tutorial's SGD with momentum 0.9 (at half its lr of 1.0)."""
    g = torch.Generator().manual_seed(0)
    model = M.make_deformer()
    opt = (torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9) if sgd else
           torch.optim.Adam(model.parameters(), lr=1e-2))
    verts, faces = M.grid_mesh()
    losses = []
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=FACTORY + "make_deformer") as rec:
        for step in range(steps):
            v, f = M.sliver(verts, faces) if step == sliver_at else (verts, faces)
            code, target = torch.randn(1, 8, generator=g), torch.rand(40, 3, generator=g)
            if on_template:  # scanned points on the template's first two rows
                target[:8] = v[:8]
            loss = rec.loss_fn(model(v, code), f, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def train_normals(out_dir, padded_at: int | None, steps: int = 4) -> list[float]:
    """Batched meshes of different face counts, padded to one (B, F, 3) face tensor with
    vertex 0 (``faces_padded`` filled with 0 instead of pytorch3d's -1) and a face mask."""
    g = torch.Generator().manual_seed(0)
    model = M.make_normal_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    verts, faces = M.grid_mesh()
    up = torch.tensor([0.0, 0.0, 1.0]).expand(4, faces.shape[0], 3)
    losses = []
    with FlightRecorder(model, opt, loss_fn=M.normal_loss, out_dir=out_dir,
                        factory=FACTORY + "make_normal_net") as rec:
        for step in range(steps):
            v = verts.expand(4, -1, -1) + 0.01 * torch.randn(4, verts.shape[0], 3, generator=g)
            f, mask = faces.expand(4, -1, -1).clone(), torch.ones(4, faces.shape[0])
            if step == padded_at:  # mesh 1 has three faces fewer: padded rows (0, 0, 0)
                f[1, -3:], mask[1, -3:] = 0, 0.0
            loss = rec.loss_fn(model(v), f, mask, up)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def train_sdf(out_dir, loss_fn, steps: int = 4, outside: list | None = None) -> list[float]:
    """IGR's loop: surface and free-space points, the free ones drawn from a box of 1.5 past
    the encoding's [-1, 1] clamp from step 2 on (a few land outside it on every axis, where
    the SDF's gradient is exactly 0)."""
    g = torch.Generator().manual_seed(0)
    model = M.make_sdf()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses = []
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                        factory=FACTORY + "make_sdf") as rec:
        for step in range(steps):
            x, gt, on = M.sdf_batch(g, box=1.5 if step >= 2 else 1.0)
            if outside is not None:
                outside.append(int((x.abs() > 1).all(-1).sum()))
            x.requires_grad_(True)
            loss = rec.loss_fn(model(x), x, gt, on)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    return losses


def test_chamfer_sqrt_of_the_expanded_distance_of_a_kept_input_point_is_precision(tmp_path):
    # the partial scan's points are in the output and in the complete cloud: their squared
    # distance |x|² + |y|² − 2 x·y is 0 in exact arithmetic and rounds to -2e-7 in float32
    with pytest.raises(NonFiniteError) as info:
        train_completion(tmp_path, M.chamfer_l1)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (True, 0, "loss", "<loss>", "aten.sqrt", [0, 1, 2, 3],
                            "precision"), rep
    assert rep["origin"]["source"] == line_of("return (torch.sqrt(d1).mean(1)"), rep["origin"]
    assert "sqrt of a negative number" in rep["hint"], rep["hint"]
    # (was: only "clamp to the domain before the op": clamp_min(0) leaves sqrt at 0, where
    # its gradient is infinite for a point that requires grad)
    assert "float64 has exactly 0 there" in rep["hint"], rep["hint"]
    assert "d.clamp_min(1e-12).sqrt()), not to 0" in rep["hint"], rep["hint"]
    assert "vector_norm(x - y" in rep["hint"], rep["hint"]


def test_chamfer_clamped_at_0_is_sqrts_backward_pole_where_a_vertex_is_on_its_target(
        tmp_path):
    # the fix "clamp to the domain" taken literally: clamp_min(0) keeps the forward finite,
    # but the zero-initialised offsets leave vertices 0-7 exactly on target points, where
    # sqrt's derivative is infinite (why the precision hint above asks for a floor above 0)
    with pytest.raises(NonFiniteError) as info:
        train_deform(tmp_path, M.deform_chamfer_l1, sliver_at=None, on_template=True)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (True, 0, "backward", "<loss>", "SqrtBackward0",
                            list(range(8)), "invalid"), rep
    assert rep["origin"]["source"] == line_of("return (d1.sqrt().mean(1)"), rep["origin"]
    assert "vector_norm(d, dim=-1)" in rep["hint"] and "sqrt(x + eps)" in rep["hint"]


def test_padded_faces_of_vertex_0_name_the_normals_0_over_0_on_that_mesh(tmp_path):
    # a face (0, 0, 0) has a zero cross product: n / |n| is 0/0 on mesh 1 only, and the face
    # mask's 0 after it does not remove a NaN
    with pytest.raises(NonFiniteError) as info:
        train_normals(tmp_path, padded_at=2)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (True, 2, "loss", "<loss>", "aten.div", [1], "invalid"), rep
    assert rep["origin"]["source"] == line_of("return n / n.norm(dim=-1, keepdim=True)")
    assert "0/0" in rep["hint"] and "add an eps" in rep["hint"], rep["hint"]


def test_cot_laplacian_without_the_area_clamp_names_the_collapsed_faces_pole(tmp_path):
    # pytorch3d clamps Heron's area at 1e-12; without it a zero-area face's cot is x/0
    with pytest.raises(NonFiniteError) as info:
        train_deform(tmp_path, M.deform_loss_unclamped, sliver_at=0)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep)[:-2] == (True, 0, "loss", "<loss>", "aten.div"), rep
    assert (rep["origin"]["made"], rep["cause"]) == ("+inf", "invalid"), rep
    assert rep["origin"]["source"] == line_of("cota = (B2 + C2 - A2) / area"), rep["origin"]
    assert "by 0" in rep["hint"] and "add an eps" in rep["hint"], rep["hint"]


def test_dihedral_angle_of_coplanar_faces_is_acos_at_1_in_the_backward(tmp_path):
    # the template is flat: adjacent unit normals are equal, cos is exactly 1, acos is 0 in
    # the forward and its derivative -1/sqrt(1 - cos²) is -inf
    with pytest.raises(NonFiniteError) as info:
        train_deform(tmp_path, M.dihedral_loss, sliver_at=None)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep)[:5] == (True, 0, "backward", "<loss>", "AcosBackward0"), rep
    assert (rep["origin"]["made"], rep["cause"]) == ("-inf", "invalid"), rep
    assert rep["origin"]["source"] == line_of("0.01 * torch.acos(cos).mean()"), rep["origin"]
    assert "exactly +-1" in rep["hint"] and "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"]


def test_a_laplacian_row_sum_rounded_to_0_under_torch_where_asks_for_a_safe_input(tmp_path):
    # the tutorial's SGD diverges (loss 0.5, 14, 56, 4e5, 1e17); at step 5 a vertex's cot
    # weights cancel to 0 in float32 (2 in float64): torch.where(w > 0, 1 / w, w) keeps the
    # 0, but its backward multiplies the 1/0 branch's inf by the gradient 0 it sends there
    with pytest.raises(NonFiniteError) as info:
        train_deform(tmp_path, M.deform_loss, sliver_at=None, steps=8, sgd=True)
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep)[:5] == (True, 5, "backward", "<loss>", "ReciprocalBackward0"), rep
    assert rep["origin"]["source"] == line_of("norm_w = torch.where(norm_w > 0, 1.0 / norm_w")
    assert rep["cause"] == "precision", rep
    assert "made by aten.reciprocal" in rep["hint"], rep["hint"]
    # (was: only the cancellation advice, a stable formula or a clamp, and no word that the
    # torch.where after the op is what sent the gradient through the 1/0)
    assert "still send the gradient through both branches" in rep["hint"], rep["hint"]
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]
    assert {p["kind"] for p in rep["precursors"]} >= {"loss_jump", "grad_norm_jump"}, rep


def test_faces_drawn_from_nan_areas_name_the_models_0_over_0_and_the_loss_that_raised(
        tmp_path):
    # the clean 3 x 3 template (no jitter) has its vertex 4 at the centroid: the direction
    # d / |d| is 0/0 there, the areas NaN, and multinomial raises in the loss before the
    # recorder's check; the recorder writes the bundle and notes it on the RuntimeError
    g = torch.Generator().manual_seed(0)
    model = M.make_normalized_deformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    verts, faces = M.grid_mesh(3)
    with pytest.raises(RuntimeError, match="multinomial") as info:
        with FlightRecorder(model, opt, loss_fn=M.sampled_chamfer, out_dir=tmp_path,
                            factory=FACTORY + "make_normalized_deformer") as rec:
            for step in range(4):
                v = verts.expand(2, -1, -1) + 0.01 * torch.randn(2, 9, 3, generator=g)
                if step == 2:
                    v[1] = verts
                target = torch.rand(2, 30, 3, generator=g)
                loss = rec.loss_fn(model(v), faces, target)
                opt.zero_grad()
                loss.backward()
                opt.step()
    bundle = next(tmp_path.glob("*.nan"))
    assert str(bundle) in " ".join(getattr(info.value, "__notes__", [])), info.value
    rep = nanreplay_json(bundle)
    assert _origin(rep) == (True, 2, "forward", "", "aten.div", [1], "invalid"), rep
    assert rep["origin"]["source"] == line_of("* d / d.norm(dim=-1, keepdim=True)")
    assert "0/0" in rep["hint"] and "add an eps" in rep["hint"], rep["hint"]
    # (was: "the model's code raised ...", with no line: the loss raised, at its multinomial)
    note = next(p for p in rep["problems"] if "code raised" in p)
    assert note.startswith("the loss function's code raised RuntimeError: invalid multinomial")
    assert line_of("idx = area.multinomial(n, replacement=True)") in note, note


def test_padded_vertices_of_a_batched_uniform_laplacian_name_the_mesh_they_pad(tmp_path):
    # mesh 3 of the step-2 batch has 12 of the 16 vertices: its 4 padded vertices have no
    # edge, degree 0, and adj @ verts / deg is 0/0 in that mesh's rows only
    g = torch.Generator().manual_seed(0)
    model = M.make_normal_net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    verts, faces = M.grid_mesh()
    e = torch.cat([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.uniform_laplacian_loss, out_dir=tmp_path,
                            factory=FACTORY + "make_normal_net") as rec:
            for step in range(4):
                v = verts.expand(4, -1, -1) + 0.01 * torch.randn(4, 16, 3, generator=g)
                edges = e.expand(4, -1, -1).clone()
                if step == 2:  # the edges into the padding repeat a real edge instead
                    keep = (edges[3] < 12).all(-1)
                    edges[3] = torch.where(keep[:, None], edges[3], edges[3][keep][0])
                    v[3, 12:] = 0.0
                loss = rec.loss_fn(model(v), edges, torch.rand(4, 30, 3, generator=g))
                opt.zero_grad()
                loss.backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert _origin(rep) == (True, 2, "loss", "<loss>", "aten.div", [3], "invalid"), rep
    assert rep["origin"]["source"] == line_of("lap = adj @ verts / deg - verts")
    assert "0/0" in rep["hint"] and "add an eps" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("run", ["chamfer_clamped", "deform_clamped", "normals_unpadded",
                                 "eikonal_outside_the_clamp", "eikonal_norm"])
def test_healthy_mesh_losses_train_without_an_event(tmp_path, run):
    # the clamped chamfer and Laplacian, meshes without padded faces, and the eikonal term's
    # sqrt at a gradient of exactly 0 (points outside the clamp): its NaN derivative is
    # dropped by the clamp's backward, so every parameter's gradient is finite
    outside: list[int] = []
    losses = {
        "chamfer_clamped": lambda: train_completion(tmp_path, M.chamfer_l1_clamped),
        "deform_clamped": lambda: train_deform(tmp_path, M.deform_loss, sliver_at=1),
        "normals_unpadded": lambda: train_normals(tmp_path, padded_at=None),
        "eikonal_outside_the_clamp": lambda: train_sdf(tmp_path, M.sdf_loss, outside=outside),
        "eikonal_norm": lambda: train_sdf(tmp_path, M.sdf_loss_norm),
    }[run]()
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))), losses
    assert not list(tmp_path.glob("*.nan"))
    if run == "eikonal_outside_the_clamp":  # (the zero gradients were there)
        assert outside[:2] == [0, 0] and min(outside[2:]) > 0, outside
