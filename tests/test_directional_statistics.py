"""End to end on directional statistics and rotations (``directional_statistics_models``):
surface normals from Vector Neurons with a von Mises-Fisher NLL on S^2, wind direction with a
(sin, cos) head and a von Mises NLL, siamese relative camera pose from the 6D representation
with the geodesic loss, head pose as unit quaternions, look-at camera targets, ArcFace over
Partial FC and over imprinted identities under bfloat16 autocast. Each planted bug of the
domain fires under the recorder and is replayed with the CLI; the healthy versions raise no
event and train bit-identically with and without the recorder. A von Mises NLL's
``log(i0(kappa))`` that overflowed was ``invalid``, "at a pole or outside its domain" (i0 has
neither), with the advice to clamp the input away from a pole: it is an overflow, fixed by
``torch.special.i0e`` (and sinh's by the log written without it); ArcFace's
``cos.clamp(-1 + 1e-7, 1 - 1e-7)`` under bfloat16 was told to clamp into (-1 + eps, 1 - eps),
which it does: the bound is 1 in bfloat16."""

from __future__ import annotations

import contextlib

import directional_statistics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS = 4  # the planted record is in the last step's batch
BAD = 5
PAIRS = 256  # the relative-pose batch of the last step


def line_of(text: str) -> str:
    return source_line("directional_statistics_models.py", text)


def batches(kind: str, bad: int | None, dups=(), mm: int | None = None):
    """``STEPS`` batches of (model args, loss args after the model's outputs); ``bad`` is
    planted in the last one (``dups``: the relative-pose pairs of one frame twice; ``mm``: a
    patch in millimetres, a station's altitude in metres)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        b = bad if step == STEPS - 1 else None
        if kind == "normals":
            pts, normal = M.neighbourhoods(g, dup=b, mm=mm if step == STEPS - 1 else None)
            out.append(((pts,), (normal,)))
        elif kind == "wind":
            x, theta = M.station_batch(g, raw=b, alpine=mm if step == STEPS - 1 else None)
            out.append(((x,), (theta,)))
        elif kind == "relpose":
            n = PAIRS if step == STEPS - 1 else 8  # the last step: a clip's pairs
            v1, v2 = torch.randn(n, 24, generator=g), torch.randn(n, 24, generator=g)
            r_gt = M.random_rotations(g, n)
            for i in dups if step == STEPS - 1 else ():
                v2[i], r_gt[i] = v1[i], torch.eye(3)  # a frame paired with itself
            out.append(((v1, v2), (r_gt,)))
        else:
            lm = torch.randn(8, 40, generator=g)
            q = torch.nn.functional.normalize(torch.randn(8, 4, generator=g), dim=-1)
            if b is not None:
                q[b] = 0  # a frame whose pose was never annotated, stored as zeros
            out.append(((lm,), (q,)))
    return out


SETUPS = {  # kind: (factory, loss)
    "normals": ("make_normals", M.vmf_s2_nll),
    "normals_sinh": ("make_normals", M.vmf_s2_nll_sinh),
    "wind": ("make_wind", M.von_mises_nll),
    "wind_scaled": ("make_wind_scaled", M.von_mises_nll_scaled),
    "relpose": ("make_relpose", M.geodesic_loss),
    "relpose_clamped": ("make_relpose", M.geodesic_loss_clamped),
    "relpose_edge": ("make_relpose", M.geodesic_loss_clamped_to_one),
    "quat": ("make_headpose", M.quat_loss),
}


def train(kind: str, out_dir, bad: int | None = None, record: bool = True, dups=(),
          steps: int = STEPS, mm: int | None = None):
    """AdamW with warm-up then cosine decay and gradient clipping, as pose and direction
    regressors train; the normals through a DataLoader of the step's patches. Returns the
    model."""
    make, crit = SETUPS[kind]
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=STEPS)
    torch.manual_seed(1)  # (the head-pose net's dropout)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"directional_statistics_models:{make}") if record else None
    data = batches(kind.split("_")[0], bad, dups, mm)[:steps]
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for args, targets in data:
            if kind.startswith("normals"):  # one loader per step: the patches in a fixed order
                loader = DataLoader(TensorDataset(*args, *targets), batch_size=len(args[0]))
                pts, normal = next(iter(loader))
                args, targets = (pts,), (normal,)
            out = model(*args)
            loss = loss_fn(*(out if isinstance(out, tuple) else (out,)), *targets)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, tmp_path, bad: int | None = BAD, dups=(), mm: int | None = None):
    with pytest.raises(NonFiniteError) as info:
        train(kind, tmp_path, bad, dups=dups, mm=mm)
    return info.value.event, info.value.bundle_path


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"], rep["cause"])


def test_a_patch_of_one_repeated_point_is_a_zero_normal_normalised_0_over_0(tmp_path):
    """A scanner's duplicated returns: one patch is a single point K times. Centred at its
    centroid it is all zeros, Vector Neurons have no bias (a bias is not equivariant), so the
    predicted normal is the zero vector and ``v / v.norm()`` is 0/0. The replay names that
    division on the patch's row, in the root's forward, with the eps advice."""
    ev, bundle = fire("normals", tmp_path)
    assert (ev["step"], ev["phase"], ev["samples"]) == (STEPS - 1, "forward", [BAD]), ev
    rep = nanreplay_json(bundle, "--try", f"drop={BAD}")
    assert origin(rep) == (STEPS - 1, "forward", "", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("mu = v / v.norm(dim=-1, keepdim=True)")
    assert "0 by 0" in rep["hint"] and "clamp_min(eps)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_the_textbook_vmf_normaliser_of_a_scan_in_millimetres_overflows_sinh(tmp_path):
    """C_3 = kappa / (4 pi sinh(kappa)) as the textbook writes it: one scan exported in
    millimetres scales the invariant features, the concentration reaches ~95 and sinh
    overflows float32 (float64 holds it). The replay names the sinh on that patch, overflow,
    the log written without sinh, and the patch's out-of-scale data to fix or drop (dropping
    it makes the step finite)."""
    ev, bundle = fire("normals_sinh", tmp_path, bad=None, mm=BAD)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "loss", "+inf"), ev
    rep = nanreplay_json(bundle, "--try", f"drop={BAD}")
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.sinh", [BAD], "overflow"), rep
    assert rep["origin"]["source"] == line_of("torch.log(torch.sinh(kappa))"), rep["origin"]
    assert "float64 holds it" in rep["hint"] and "out of scale" in rep["hint"], rep["hint"]
    assert "log(sinh(x)) = x + log1p(-exp(-2 * x)) - log(2)" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_log_i0_of_a_concentration_past_float32_is_an_overflow_fixed_by_i0e(tmp_path):
    """One station's pressure kept in Pa (101325, never standardised) drives the softplus
    concentration to ~5000, and ``log(torch.special.i0(kappa))`` of the von Mises NLL
    overflows (I0 grows like e^kappa): a loss event, named at aten.i0 on the station's row,
    ``overflow`` (i0 has no pole or domain edge), with the exponentially scaled variant as
    the fix and the record's out-of-scale data."""
    ev, bundle = fire("wind", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.i0", [BAD], "overflow"), rep
    assert rep["origin"]["source"] == line_of("torch.log(torch.special.i0(kappa))")
    hint = rep["hint"]
    assert "log(torch.special.i0e(x)) + x.abs()" in hint and "pole" not in hint, hint
    assert "out of scale" in hint and f"drop={BAD}" in hint, hint


def test_log_i0_past_float32_that_float64_holds_is_still_fixed_by_i0e_not_float64(tmp_path):
    """An alpine station's altitude in metres (2300) drives kappa to ~100: i0 overflows
    float32 and float64 holds it, but float64 only moves the edge (to kappa ≈ 713); the hint
    gives the scaled variant in place of the generic "rescale or compute it in float64"."""
    ev, bundle = fire("wind", tmp_path, bad=None, mm=BAD)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "loss", "+inf"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.i0", [BAD], "overflow"), rep
    hint = rep["hint"]
    assert "float64 holds it" in hint and "torch.special.i0e(x)" in hint, hint
    assert "compute it in float64" not in hint and "out of scale" in hint, hint


def test_the_scaled_von_mises_nll_trains_through_the_same_record_unchanged(tmp_path):
    """``log(i0e(kappa)) + kappa`` on the same batches: no event, and the weights are
    bit-identical with and without the recorder."""
    recorded = train("wind_scaled", tmp_path, BAD)
    plain = train("wind_scaled", tmp_path, BAD, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


DUPS = tuple(range(1, PAIRS, 2))  # (which of them round past 1 depends on the CPU: see last_cosines)


def last_cosines() -> torch.Tensor:
    """The geodesic cosines of the last step's pairs, computed on an unrecorded copy of the
    run (which self-paired rows round past 1, or to exactly 1, depends on how the CPU's
    kernels sum)."""
    model = train("relpose", None, steps=STEPS - 1, record=False, dups=DUPS)
    (v1, v2), (r_gt,) = batches("relpose", None, DUPS)[-1]
    with torch.no_grad():
        rel = model(v1, v2)
        return (torch.diagonal(rel.transpose(-1, -2) @ r_gt, dim1=-2, dim2=-1).sum(-1) - 1) / 2


def test_a_frame_paired_with_itself_rounds_the_geodesic_cosine_past_one(tmp_path):
    """Relative pose of a frame paired with itself (a video's repeated frame): ``R1^T R2`` is
    the identity up to rounding and the trace's cosine rounds to 1.0000001 on some pairs, so
    the unclamped ``acos`` is NaN there. The replay names the acos in the loss on exactly those
    pairs, ``precision``, and the clamp inside (-1, 1). Which pairs round past 1 follows the
    CPU's kernels (11 of the 128 self-paired rows with AVX2/AVX-512, 10 others with the scalar
    kernels, none of the 4 an 8-pair batch had there), so the rows come from an unrecorded
    run and the clip has enough of them that some always do."""
    rows = torch.nonzero(last_cosines() > 1).flatten().tolist()
    assert rows and set(rows) <= set(DUPS), rows
    ev, bundle = fire("relpose", tmp_path, bad=None, dups=DUPS)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.acos", rows, "precision"), rep
    assert rep["origin"]["source"] == line_of("return torch.acos(cos).mean()"), rep["origin"]
    assert "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"], rep["hint"]


def test_a_geodesic_cosine_clamped_onto_one_is_acos_at_its_edge_in_backward(tmp_path):
    """``cos.clamp(-1, 1)``, as many repositories write it, keeps the forward finite but puts
    the self-paired rows on acos's edge, where its derivative is infinite: a backward event.
    The replay names AcosBackward0 in the loss on exactly the rows whose cosine is 1 after
    the clamp, ``invalid`` (the identity's cosine is 1 in exact arithmetic too), and the clamp
    inside (-1, 1)."""
    rows = torch.nonzero(last_cosines() >= 1).flatten().tolist()
    assert rows and set(rows) <= set(DUPS), rows
    ev, bundle = fire("relpose_edge", tmp_path, bad=None, dups=DUPS)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (STEPS - 1, "backward", "<loss>", "AcosBackward0", rows,
                           "invalid"), rep
    assert rep["origin"]["source"] == line_of("return torch.acos(cos.clamp(-1, 1)).mean()")
    assert "exactly +-1" in rep["hint"] and "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"]


def test_an_unannotated_pose_stored_as_a_zero_quaternion_is_the_records_fault(tmp_path):
    """A frame never annotated, its quaternion written as (0, 0, 0, 0): the loss renormalises
    the target, 0/0. The replay names the loss's division on that frame and says the record
    is degenerate (data alone, nothing the model learns): repair or skip it, no eps."""
    ev, bundle = fire("quat", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (STEPS - 1, "loss", "nan"), ev
    rep = nanreplay_json(bundle)
    assert origin(rep) == (STEPS - 1, "loss", "<loss>", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("q_gt = q_gt / q_gt.norm(dim=-1, keepdim=True)")
    assert "computed from the batch's data alone" in rep["hint"], rep["hint"]
    assert "drop or repair such records" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,dups,mm", [("relpose_clamped", DUPS, None), ("quat", (), None),
                                          ("normals", (), BAD)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, dups, mm):
    """The clamped geodesic loss over the same self-paired frames, the quaternion head with
    its dropout, the Vector Neurons through a DataLoader with the stable log C_3 over the scan
    in millimetres (kappa ~100): no event, and bit-identical weights with and without the
    recorder."""
    recorded = train(kind, tmp_path, dups=dups, mm=mm)
    plain = train(kind, tmp_path, record=False, dups=dups, mm=mm)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def train_lookat(out_dir, nadir: int | None, record: bool = True):
    """The 6D regressor on drone views whose rotations the dataset builds with look-at,
    through a DataLoader, the clamped geodesic loss; ``nadir``'s view in the last step looks
    straight down."""
    model = M.make_abspose()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.geodesic_loss_clamped, out_dir=out_dir,
                         factory="directional_statistics_models:make_abspose") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.geodesic_loss_clamped
        for step in range(STEPS):
            views = M.LookAtViews(g, nadir=nadir if step == STEPS - 1 else None)
            for x, r_gt in DataLoader(views, batch_size=8):
                loss = loss_fn(model(x), r_gt)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def test_a_nadir_view_makes_the_look_at_target_nan_and_names_the_data(tmp_path):
    """A drone's nadir view looks straight down, along the world's up: look-at's
    ``cross(fwd, up)`` is the zero vector and normalising it is 0/0, in the dataset's
    ``__getitem__``. The recorder stops at the loss's target before anything is computed from
    it; the replay names that argument by its parameter name, the view's row, ``input``, and
    the data pipeline to fix."""
    with pytest.raises(NonFiniteError) as info:
        train_lookat(tmp_path, nadir=BAD)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (
        STEPS - 1, "input", "loss_args[1]", [BAD]), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["cause"]) == (
        "input", [BAD], "input"), rep
    assert "loss_args[1] (r_gt)" in rep["hint"] and "fix the data pipeline" in rep["hint"]


def train_face(out_dir, forgot_positives: bool, record: bool = True):
    """ArcFace over Partial FC, as insightface trains it: SGD with momentum and weight decay,
    half the classes sampled per step, the batch's own classes always among them (a sampler
    that forgot them in the last step with ``forgot_positives``). The model returns the loss
    per sample; the loop takes the mean."""
    model = M.make_face()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=STEPS, power=2.0)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, out_dir=out_dir,
                         factory="directional_statistics_models:make_face") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for step in range(STEPS):
            x = torch.randn(16, 24, generator=g)
            y = torch.randint(0, M.N_ID, (16,), generator=g)
            sampled = torch.zeros(M.N_ID, dtype=torch.bool)
            sampled[torch.randperm(M.N_ID, generator=g)[:M.N_ID // 2]] = True
            if not (forgot_positives and step == STEPS - 1):
                sampled[y] = True
            loss = model(x, y, sampled.expand(len(y), -1)).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model, (y, sampled)


def test_partial_fc_that_left_out_the_batchs_own_classes_names_the_masked_targets(tmp_path):
    """The class sampler forgot to add the batch's positive classes: their logits are the
    -inf of the mask, and the cross-entropy of a target on a masked class is +inf. The event
    is the head's output on those samples; the replay names the nll_loss that folded the
    mask's -inf in (after the masked_fill), on the same samples, and the target on a masked
    class."""
    with pytest.raises(NonFiniteError) as info:
        train_face(tmp_path, forgot_positives=True)
    _, (y, sampled) = train_face(None, forgot_positives=True, record=False)
    rows = torch.nonzero(~sampled[y]).flatten().tolist()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == (
        STEPS - 1, "forward", "head", "+inf", rows), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == (STEPS - 1, "forward", "head", "aten.nll_loss_forward", rows,
                           "invalid"), rep
    assert [c["op"] for c in rep["origin"]["chain"]] == ["aten.masked_fill",
                                                         "aten.nll_loss_forward"], rep
    assert "a target on a masked class" in rep["hint"], rep["hint"]


def test_healthy_partial_fc_with_its_inf_mask_inside_the_head_trains_the_same(tmp_path):
    """The -inf mask stays inside the head (its per-sample losses are finite): no event, and
    bit-identical weights with and without the recorder."""
    recorded, _ = train_face(tmp_path, forgot_positives=False)
    plain, _ = train_face(tmp_path, forgot_positives=False, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_healthy_look_at_views_train_the_same(tmp_path):
    """Oblique views only (look-at well defined): no event, bit-identical weights."""
    recorded = train_lookat(tmp_path, nadir=None)
    plain = train_lookat(tmp_path, nadir=None, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def imprinted(make: str):
    """The model with one class centre per enrolment image (its normalised embedding), and
    the enrolment batch."""
    model = getattr(M, make)()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(M.N_ID, 24, generator=g), torch.arange(M.N_ID)
    with torch.no_grad():
        model.head.weight.copy_(torch.nn.functional.normalize(model.backbone(x)))
    return model, x, y


def train_imprinted(out_dir, make: str, record: bool = True):
    """New identities enrolled by weight imprinting (Qi et al. 2018): each class centre is its
    enrolment image's normalised embedding, then ArcFace fine-tunes on the enrolment batch
    under bfloat16 autocast. Returns the model and the batch."""
    model, x, y = imprinted(make)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampled = torch.ones(M.N_ID, M.N_ID, dtype=torch.bool)
    rec = FlightRecorder(model, opt, out_dir=out_dir,
                         factory=f"directional_statistics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y, sampled).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, x


def test_an_arcface_clamp_whose_eps_bfloat16_rounds_away_names_the_bound(tmp_path):
    """ArcFace's ``cos.clamp(-1 + 1e-7, 1 - 1e-7)`` under bfloat16 autocast: 1 - 1e-7 is 1.0
    in bfloat16, the imprinted identities' cosines round to 1 or past it and are clamped to
    exactly 1, and acos's derivative is infinite there. The replay names AcosBackward0 in the
    head on those identities, ``precision``; the hint said to clamp into (-1 + eps, 1 - eps),
    which the code does: it now says the bound is 1 in bfloat16 and what eps the type keeps."""
    model, x, _ = imprinted("make_face")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (the head's cosines)
        cos = torch.nn.functional.linear(torch.nn.functional.normalize(model.backbone(x)),
                                         torch.nn.functional.normalize(model.head.weight))
        rows = torch.nonzero(cos.diagonal().clamp(-1 + 1e-7, 1 - 1e-7) == 1).flatten().tolist()
    assert len(rows) > M.N_ID // 2, rows
    with pytest.raises(NonFiniteError) as info:
        train_imprinted(tmp_path, "make_face")
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    rep = nanreplay_json(info.value.bundle_path)
    assert origin(rep) == (0, "backward", "head", "AcosBackward0", rows, "precision"), rep
    assert rep["origin"]["source"] == line_of("torch.cos(torch.acos(target) + self.m)")
    hint = rep["hint"]
    assert "its bound 0.9999999 is 1 in bfloat16" in hint and "at least 0.00391" in hint, hint


def test_arcface_cosines_in_float32_under_autocast_train_the_same(tmp_path):
    """The fix: the head's cosines in float32 (autocast off there), the same imprinting and
    bfloat16 backbone: no event, and bit-identical weights with and without the recorder."""
    recorded, _ = train_imprinted(tmp_path, "make_face_fp32_cos")
    plain, _ = train_imprinted(tmp_path, "make_face_fp32_cos", record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_accumulated_micro_batches_name_the_station_in_its_micro_batch_and_the_loops_batch(
        tmp_path):
    """Gradient accumulation over two chunks of 8 of the loop's batch of 16, the Pa record in
    row 13: the event is the second micro-batch's loss; the replay names aten.i0 there, sample
    5 of that micro-batch and row 13 of the loop's batch."""
    model = M.make_wind()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=M.von_mises_nll, out_dir=tmp_path,
                            factory="directional_statistics_models:make_wind") as rec:
            for step in range(STEPS):
                x, theta = M.station_batch(g, raw=13 if step == STEPS - 1 else None)
                opt.zero_grad()
                for xs, ts in zip(x.chunk(2), theta.chunk(2)):
                    (rec.loss_fn(*model(xs), ts) / 2).backward()
                opt.step()
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["micro_batch"]) == (STEPS - 1, "loss", 1), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["micro_batch"], o["op"], o["samples"], o["batch_rows"], rep["cause"]) == (
        1, "aten.i0", [5], [13], "overflow"), o
    assert "torch.special.i0e(x)" in rep["hint"], rep["hint"]
