"""End to end: protein structure models (``protein_structure_models``: an OpenFold-style
structure module with backbone frames by Gram-Schmidt, invariant point attention, quaternion
backbone updates, torsion angles normalised by their norm, recycling, FAPE and a per-chain
distogram loss; Satorras et al.'s EGNN over the residues' CA atoms), trained on padded chains
from a DataLoader (AdamW with warmup, gradient clipping) under the recorder until a planted
bug fires, then replayed with the CLI."""

from __future__ import annotations

import protein_structure_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

K, BAD = 2, 2  # the step the planted chain is in, and its row


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("protein_structure_models.py", text)


def train_structure(out_dir, plant: str, model_kw=None, loss_kw=None, steps: int = 4):
    """AdamW with a linear warmup and gradient clipping on FAPE + distogram; returns the
    error, or None when every step trained."""
    model_kw = model_kw or {}
    model = M.make_structure(**model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    crit = M.AlphaFoldLoss(**(loss_kw or {}))
    loader = DataLoader(M.dataset(plant, K, BAD, steps), batch_size=M.BATCH,
                        collate_fn=M.collate)
    trained = 0
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="protein_structure_models:make_structure",
                            factory_kwargs=model_kw) as rec:
            for b in loader:
                opt.zero_grad()
                out = model(b["aatype"], b["coords"], b["mask"])
                loss = rec.loss_fn(out, b["coords"], b["mask"], b["resolution"])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                warmup.step()
                assert torch.isfinite(loss)
                trained += 1
    except NonFiniteError as e:
        return e
    assert trained == steps
    return None


def train_egnn(out_dir, plant: str, steps: int = 4, **kw):
    """Denoising the CA atoms with an EGNN over each chain's residues (padding included, as a
    loop that builds the edges from the crop length does)."""
    model = M.make_egnn(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(M.dataset(plant, K, BAD, steps), batch_size=M.BATCH,
                        collate_fn=M.collate)
    g = torch.Generator().manual_seed(2)
    trained = 0
    try:
        with FlightRecorder(model, opt, loss_fn=M.egnn_loss, out_dir=out_dir,
                            factory="protein_structure_models:make_egnn",
                            factory_kwargs=kw) as rec:
            for b in loader:
                ca, mask = b["coords"][:, :, 1], b["mask"]
                noisy = ca + 0.5 * torch.randn(ca.shape, generator=g) * mask[..., None]
                edges = M.fully_connected_edges([M.LENGTH] * len(ca), ca.shape[1])
                opt.zero_grad()
                loss = rec.loss_fn(model(b["aatype"], noisy, edges), ca, mask)
                loss.backward()
                opt.step()
                trained += 1
    except NonFiniteError as e:
        return e
    assert trained == steps
    return None


@pytest.mark.parametrize("plant", ["unresolved", "short", "empty"])
def test_healthy_padded_and_unresolved_chains_train_without_an_event(tmp_path, plant):
    # the shipped eps's (frames 1e-8, torsion norm 1e-12, FAPE 1e-4, per chain 1e-6) keep
    # zero coordinates, padding and a chain without resolved residue finite
    assert train_structure(tmp_path / "s", plant) is None
    assert train_egnn(tmp_path / "e", plant) is None
    assert not list(tmp_path.rglob("*.nan"))


def test_frames_of_an_unresolved_residue_with_eps_0_name_the_gram_schmidt_division(tmp_path):
    # residues 2 and 5 of chain BAD are unresolved: N = CA = C = 0, so c - ca is 0 and its
    # normalisation 0 / sqrt(0 + 0) is NaN in FrameDiff-style frames of the input coordinates
    err = train_structure(tmp_path, "unresolved", model_kw={"frame_eps": 0.0})
    assert (err.event["step"], err.event["phase"]) == (K, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "", "aten.div", "nan", [BAD]), rep
    assert o["source"] == line_of("e1 = v1 / torch.sqrt("), o["source"]
    assert "0 by 0" in rep["hint"] and "eps added to that input is exactly 0" in rep["hint"]


def test_true_frames_in_the_loss_with_eps_0_ask_for_the_eps_not_to_drop_the_chain(tmp_path):
    # the same frames of the target coordinates, in the loss: computed from the data alone,
    # but the eps the code carries (0) is the fix, and the masked residues are no bad record
    err = train_structure(tmp_path, "unresolved", loss_kw={"frame_eps": 0.0})
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", [BAD]), rep
    assert o["source"] == line_of("e1 = v1 / torch.sqrt("), o["source"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    # (was also: "a record of the samples named is degenerate ... an eps there would train
    # toward a made-up target", against the eps advice in the same hint)
    assert "made-up target" not in rep["hint"] and "degenerate" not in rep["hint"], rep["hint"]


def test_torsion_norm_clamped_at_a_floor_of_0_names_the_floor(tmp_path):
    # AngleResnet's sqrt(clamp(sum(s ** 2), min=eps)) with eps 0: a padded residue's masked
    # unnormalised angle is (0, 0), and 0 / 0 is NaN in the short chain's rows
    err = train_structure(tmp_path, "short", model_kw={"angle_eps": 0.0})
    assert (err.event["step"], err.event["phase"]) == (K, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "angles", "aten.div", "nan", [BAD]), rep
    assert o["source"] == line_of("return unnorm / norm"), o["source"]
    # (was: only "add an eps to the denominator (std + eps, d.clamp_min(eps))", to a user
    # whose code clamps with an eps already)
    assert "floor that input is clamped to is exactly 0" in rep["hint"], rep["hint"]


def test_fape_without_its_eps_is_sqrt_at_0_on_each_residue_paired_with_itself(tmp_path):
    # FAPE's sqrt(d^2 + eps) with eps 0: a residue's own CA in its own frame is 0 away in
    # both structures, so the forward is finite and sqrt's backward is 1 / 0 in every chain
    err = train_structure(tmp_path, "short", loss_kw={"fape_eps": 0.0})
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "SqrtBackward0", list(range(M.BATCH))), rep
    assert o["source"] == line_of("d = torch.sqrt(((x_p - x_t)"), o["source"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]


def test_a_chain_with_no_resolved_residue_names_its_per_chain_mean(tmp_path):
    # the distogram loss averaged per chain over its resolved pairs with eps 0: chain BAD
    # has none, 0 / 0
    err = train_structure(tmp_path, "empty", loss_kw={"per_chain_eps": 0.0})
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "invalid", "<loss>", "aten.div", [BAD]), rep
    assert o["source"] == line_of("ce = (ce * pair).sum((1, 2))"), o["source"]
    assert "0 by 0" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]


def test_egnn_without_epsilon_names_the_chain_of_the_coincident_residues(tmp_path):
    # E_GCL's coord_diff / (sqrt(radial) + epsilon) with epsilon 0: chain BAD's two
    # unresolved residues both sit at the origin, and their edge is 0 / 0. The layer's
    # arguments (h, x, row, col) are as many as the chains: they are no per-chain records
    err = train_egnn(tmp_path, "unresolved", epsilon=0.0)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (K, "forward", [BAD])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (was: samples [1, 2, 3], the positions of x, row and col in the layer's arguments)
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "layers.0", "aten.div", "nan", [BAD]), rep
    assert o["source"] == line_of("coord_diff = coord_diff / norm"), o["source"]
    assert "eps added to that input is exactly 0" in rep["hint"], rep["hint"]
    assert "made-up target" not in rep["hint"], rep["hint"]


def test_a_zero_initialised_full_quaternion_update_names_the_layer_not_only_an_eps(tmp_path):
    # AF2 zero-initialises the backbone update (init="final"); predicting all four quaternion
    # components, not OpenFold's (1, b, c, d), makes q = 0 and q / |q| is 0/0 at step 0 for
    # every residue. An eps alone keeps q at 0: a rotation matrix of zeros
    err = train_structure(tmp_path, "short", model_kw={"full_quaternion": True})
    assert (err.event["step"], err.event["phase"]) == (0, "forward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "bb_update", "aten.div", "nan", list(range(M.BATCH))), rep
    assert o["source"] == line_of("q = q / q.norm("), o["source"]
    # (was: only "add an eps to the denominator (std + eps, d.clamp_min(eps))")
    hint = rep["hint"]
    assert "parameter bb_update.linear.weight, all 0" in hint, hint
    assert "(1, b, c, d)" in hint and "small random values" in hint, hint


def test_a_geodesic_rotation_loss_at_the_identity_is_acos_rounded_to_1(tmp_path):
    # acos((trace(R_pred^T R_true) - 1) / 2), clamped to [-1, 1]: the zero-initialised
    # backbone update leaves the predicted frames the true ones at step 0, the cosine rounds
    # to exactly 1, and acos's derivative there is infinite (finite in float64)
    err = train_structure(tmp_path, "short", loss_kw={"rotation_weight": 0.1})
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["samples"]) == (
        "precision", "<loss>", "AcosBackward0", list(range(M.BATCH))), rep
    assert o["source"] == line_of("angle = torch.acos("), o["source"]
    assert "cos.clamp(-1 + eps, 1 - eps)" in rep["hint"] and "atan2" in rep["hint"], rep["hint"]


def test_a_per_chain_plddt_cross_entropy_of_a_chain_without_resolved_residue(tmp_path):
    # the loss loops over the chains, F.cross_entropy over each one's residues with the
    # unresolved ones ignore_index: chain BAD has none resolved, the mean of nothing is 0/0,
    # named by the chain the loop's logits[b] took
    err = train_structure(tmp_path, "empty", loss_kw={"plddt_weight": 0.1})
    assert (err.event["step"], err.event["phase"]) == (K, "loss")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        "invalid", "<loss>", "aten.nll_loss_forward", "nan", [BAD]), rep
    assert o["source"] == line_of("per_chain = [F.cross_entropy("), o["source"]
    assert "ignore_index" in rep["hint"] and "max(count, 1)" in rep["hint"], rep["hint"]
