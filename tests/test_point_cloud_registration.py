"""End to end: learned point cloud registration as Deep Closest Point and RPM-Net train it
(``point_cloud_registration_models``: PointNet features of two clouds, soft correspondences
under an annealed temperature, RPM's Sinkhorn, weighted Procrustes through
``torch.linalg.svd`` with the determinant fix, the geodesic rotation loss, ModelNet-like
pairs with partial overlap and duplicated points, Adam with gradient clipping), trained
under the recorder from a DataLoader until a planted bug of the domain fires, then replayed
with the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import point_cloud_registration_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


def line_of(text: str) -> str:
    return source_line("point_cloud_registration_models.py", text)


def pairs(**kw) -> list[torch.Tensor]:
    """``(src, tgt, R_gt, t_gt, valid)``: every source point weighted 1."""
    src, tgt, r_gt, t_gt = M.clouds(**kw)
    return [src, tgt, r_gt, t_gt, torch.ones(src.shape[:2])]


def fit(data, model, opt, loss, rec=None, anneal=None, epochs: int = 1) -> list[float]:
    """Epochs over shuffled pairs; ``anneal(step)`` sets the matching temperature; gradients
    clipped to norm 1, as DCP's training does."""
    call = rec.loss_fn if rec is not None else loss
    losses, step = [], 0
    for _ in range(epochs):
        for src, tgt, r_gt, t_gt, valid in DataLoader(TensorDataset(*data), batch_size=BATCH):
            if anneal is not None:
                model.match.tau = anneal(step)
            opt.zero_grad()
            r, t = model(src, tgt, valid)
            value = call(r, t, r_gt, t_gt, src, tgt)
            value.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(value.detach()))
            step += 1
    return losses


def run(tmp_path: Path, data, factory: str = "make_dcp", loss=None, recorded: bool = True,
        **kw):
    model, loss = getattr(M, factory)(), loss or M.RegistrationLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if not recorded:
        return fit(data, model, opt, loss, **kw), model
    with FlightRecorder(model, opt, loss_fn=loss, out_dir=tmp_path,
                        factory=f"point_cloud_registration_models:{factory}") as rec:
        return fit(data, model, opt, loss, rec, **kw), model


def fired(tmp_path: Path, error, *args, **kw) -> tuple[dict, dict]:
    """Train until ``error`` (NonFiniteError, or the LinAlgError the NaN then raises in the
    SVD, which the recorder lets through after writing its bundle); the replayed report."""
    with pytest.raises(error):
        run(tmp_path, *args, **kw)
    bundle, = tmp_path.glob("*.nan")
    rep = nanreplay_json(bundle)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    return rep, rep["origin"]


@pytest.mark.parametrize("factory", ["make_dcp", "make_rpm_net"])
def test_healthy_registration_raises_nothing_and_trains_bit_identically(tmp_path, factory):
    data = pairs()
    loss = M.RegistrationLoss(chamfer=0.1)
    (plain, m0), (watched, m1) = (run(tmp_path, data, factory, loss, recorded, epochs=2)
                                  for recorded in (False, True))
    assert plain == watched
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))
    assert not list(tmp_path.glob("*.nan"))


def test_a_point_without_a_depth_return_is_named_as_a_missing_point(tmp_path):
    """Target point 5 of pair 20 (the second batch's sample 4) is NaN in every coordinate (a
    depth pixel with no return, back-projected). The SVD then raises; the recorder's bundle
    names the input. The hint called it a per-channel standardisation by a zero std (a
    disconnected electrode); it now says whole points of a set, never measured."""
    data = pairs()
    data[1][20, 5] = float("nan")
    rep, o = fired(tmp_path, torch.linalg.LinAlgError, data)
    assert (rep["event"]["step"], o["phase"], o["samples"], rep["cause"]) == (
        1, "input", [4], "input"), json.dumps(rep, indent=1)
    assert "in whole points of its samples' sets" in rep["hint"], rep["hint"]
    assert "sample 4 at index 5 of dim 1, every coordinate of each (3 values)" in rep["hint"]
    assert "electrode" not in rep["hint"], rep["hint"]


def test_a_hand_written_softmax_under_an_annealed_temperature_overflows(tmp_path):
    """DCP's pointer written as ``exp(s / tau) / exp(s / tau).sum()`` with ``tau = 0.1 **
    step``: at step 2 (tau 0.01) the feature scores of two pairs pass exp's range."""
    rep, o = fired(tmp_path, torch.linalg.LinAlgError, pairs(), "make_dcp_unstable",
                   anneal=lambda s: 0.1 ** s)
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"],
            rep["cause"]) == (2, "match", "aten.exp", "+inf", [0, 5], "overflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("e = torch.exp(scores / self.tau)")
    assert "a softmax written by hand" in rep["hint"], rep["hint"]


def test_rpm_affinities_of_a_cloud_out_of_scale_underflow_to_0_by_0(tmp_path):
    """RPM's affinity ``exp(-||f_s - f_t||^2 / tau)`` normalised by hand, on clouds in
    centimetres (30x the unit scale): every affinity of a row is below float32's range (1e-99
    in float64), the normalisation 0/0 at 15 of the 16 pairs. The hint said to compute in log
    space or clamp the value away from 0 (Cox losses, KLDivLoss), as for any underflowed
    divisor; it now names the softmax written by hand, as it did where float64 underflows too,
    and says torch.softmax (a clamp of the sum leaves every weight 0)."""
    data = pairs(scale=30.0)
    model, (src, tgt) = M.make_rpm(), (data[0][:BATCH], data[1][:BATCH])
    with torch.no_grad():  # the rows whose every affinity is 0 at step 0 (tau 1)
        p = model.match(model.emb(src), model.emb(tgt), src, tgt)
    rows = p.isnan().flatten(1).any(1).nonzero().flatten().tolist()
    assert 0 < len(rows) < BATCH
    rep, o = fired(tmp_path, torch.linalg.LinAlgError, data, "make_rpm",
                   anneal=lambda s: 0.5 ** s)
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"],
            rep["cause"]) == (0, "match", "aten.div", "nan", rows, "underflow"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return e / e.sum(-1, keepdim=True)")
    assert "that input is 4.74e-99 in float64" in rep["hint"], rep["hint"]
    assert "written by hand" in rep["hint"] and "use torch.softmax(s, dim)" in rep["hint"]
    assert "clamp the value away from 0" not in rep["hint"], rep["hint"]


def test_a_target_cropped_to_one_duplicated_point_breaks_only_the_svd_backward(tmp_path):
    """Pair 3's target kept one point, duplicated into every slot: its cross-covariance is 0,
    three equal singular values, and svd's backward divides by their differences. The
    forward (any rotation) is finite; the backward is NaN at that sample."""
    data = pairs()
    data[1][3] = data[1][3][:1].expand(M.N_POINTS, 3)
    rep, o = fired(tmp_path, NonFiniteError, data)
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (0, "backward", "head", "LinalgSvdBackward0", [3], "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("u, s, vh = torch.linalg.svd(h)")
    assert "repeated singular values" in rep["hint"], rep["hint"]


def exact_pairs() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Pairs with no motion, noise or crop, and the geodesic's cosine of the first batch as
    the untrained RPM-Net (tau 1e-3) registers them: 1 up to rounding."""
    data = pairs(max_angle=0.0, noise=0.0, overlap=1.0, shift=0.0)
    model = M.make_rpm_net()
    model.match.tau = 1e-3
    with torch.no_grad():
        r, _ = model(data[0][:BATCH], data[1][:BATCH], data[4][:BATCH])
    prod = r.transpose(1, 2) @ data[2][:BATCH]
    return data, (torch.diagonal(prod, dim1=1, dim2=2).sum(-1) - 1) / 2


def test_the_geodesic_angle_without_a_clamp_rounds_past_1_on_exact_pairs(tmp_path):
    """Pairs with no motion and no noise, matched hard (tau 1e-3): the SVD gives the identity
    up to rounding, ``(trace(R^T R_gt) - 1) / 2`` is 1.0000005 at some pairs, ``acos`` NaN;
    a precision loss, to clamp."""
    data, cos = exact_pairs()
    rows = (cos > 1).nonzero().flatten().tolist()
    assert 0 < len(rows) < BATCH
    rep, o = fired(tmp_path, NonFiniteError, data, "make_rpm_net",
                   M.RegistrationLoss(clamp=False), anneal=lambda s: 1e-3)
    assert (rep["event"]["step"], o["module"], o["op"], o["made"], o["samples"],
            rep["cause"]) == (0, "<loss>", "aten.acos", "nan", rows, "precision"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.acos(cos)")
    assert "clamp the input into the domain" in rep["hint"], rep["hint"]


def test_the_geodesic_cosine_clamped_to_exactly_1_is_backward_only(tmp_path):
    """The same exact pairs with the cosine clamped to ``[-1, 1]`` (no margin): the forward is
    finite, but at the pairs whose cosine reached 1 acos's derivative is -inf there: NaN in
    the backward only, at exactly those pairs."""
    data, cos = exact_pairs()
    rows = (cos >= 1).nonzero().flatten().tolist()
    assert 0 < len(rows) < BATCH
    rep, o = fired(tmp_path, NonFiniteError, data, "make_rpm_net",
                   M.RegistrationLoss(clamp_eps=0.0), anneal=lambda s: 1e-3)
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (0, "backward", "<loss>", "AcosBackward0", rows, "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == line_of("return torch.acos(cos)")
    assert "its input is exactly +-1, the edge of acos's domain" in rep["hint"], rep["hint"]
