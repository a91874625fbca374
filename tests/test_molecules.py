"""Interatomic potentials trained on energies and forces as SchNetPack, NequIP and DimeNet
train them (``molecule_models``): molecules concatenated atom by atom with a ``batch`` vector,
the forces ``-dE/dpos`` from ``autograd.grad(..., create_graph=True)`` (in the model's forward,
or in the loss given the positions), and a loss mixing energy and force errors, so the step's
backward differentiates twice. Each test trains until the recorder raises, then runs
``nanreplay --json`` on the bundle. The samples are the molecules, which the atoms outnumber."""

from __future__ import annotations

from pathlib import Path

import molecule_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K, BAD = 2, 3  # the step the planted bug fires at, and the molecule it is in (of 5)


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(plant: str, out_dir: Path, **kw) -> NonFiniteError:
    """Adam on the energy-and-forces loss until the recorder raises; ``forces=False``: the
    model returns the energy and the loss takes its derivative, given the positions."""
    model = M.make_schnet(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.EnergyForceLoss()
    in_loss = kw.get("forces") is False
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="molecule_models:make_schnet", factory_kwargs=kw):
            for z, pos, batch, e, f in M.batches(plant, K, BAD):
                opt.zero_grad()
                out = model(z, pos, batch, len(e))
                loss = crit(out, e, f, pos) if in_loss else crit(out, e, f)
                loss.backward()
                opt.step()
    assert info.value.event["step"] == K, info.value.event
    return info.value


def _step_k(plant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Step K's positions and batch vector, from the data alone."""
    *_, (z, pos, batch, e, f) = M.batches(plant, K, BAD, steps=K + 1)
    return pos, batch


def _molecules_with_coincident_atoms() -> list[int]:
    pos, batch = _step_k("coincident")
    same = (batch[:, None] == batch[None, :]) & ~torch.eye(len(pos), dtype=torch.bool)
    hit = same & ((pos[:, None] - pos[None, :]) == 0).all(-1)
    return sorted(set(batch[hit.any(1)].tolist()))


def _molecules_with_a_straight_angle() -> list[int]:
    """Molecules with atoms k, j, i (within the model's cutoff) on a line, j between them."""
    pos, batch = _step_k("linear")
    v = pos[None, :, :] - pos[:, None, :]  # v[j, k]: from atom j to atom k
    d = v.norm(dim=-1)
    cos = (v[:, :, None] * v[:, None, :]).sum(-1) / (d[:, :, None] * d[:, None, :])
    near = (d < 5.0) & (batch[:, None] == batch[None, :]) & (d > 0)
    straight = (cos == -1) & near[:, :, None] & near[:, None, :]
    return sorted(set(batch[straight.flatten(1).any(1)].tolist()))


def _line(marker: str) -> str:
    lines = (HERE / "molecule_models.py").read_text().splitlines()
    return f"molecule_models.py:{next(i for i, t in enumerate(lines, 1) if marker in t)}"


def test_coincident_atoms_name_the_molecule_whose_forces_are_nan(tmp_path):
    """An atom written twice at one position: the pair's distance is 0, finite, and so is
    the energy; the forward's autograd.grad runs SqrtBackward0 at 0 and only the forces,
    one row per atom, are NaN. Those rows are atoms, which the batch vector assigns to
    molecules: before, no sample was named (neither by the recorder nor the replay), as
    only the tensors beside the batch vector in one call were mapped through it."""
    err = _train("coincident", tmp_path)
    bad = _molecules_with_coincident_atoms()
    assert bad == [BAD]
    assert (err.event["phase"], err.event["module"], err.event["samples"]) == (
        "forward", "", bad)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["node"], o["node_source"], o["samples"],
            rep["cause"]) == ("forward", "", "aten.div", "SqrtBackward0",
                              _line("d = torch.sqrt("), bad, "invalid"), rep
    assert o["batch_size"] == 5


def test_forces_taken_in_the_loss_name_the_molecule_of_the_zero_distance(tmp_path):
    """The model returns the energy and the loss takes -dE/dpos (NequIP's and MACE's
    trainers): the loss is NaN with finite outputs, and the replay names SqrtBackward0 in
    ``distances``. Its gradient is one row per edge, no sample; the atoms' gradient it
    reaches names the molecule. Before, the samples were [] (and anomaly mode's NaN check
    stopped the loss's autograd.grad before any per-atom gradient was seen)."""
    err = _train("coincident", tmp_path, forces=False)
    assert (err.event["phase"], err.event["module"]) == ("loss", "<loss>"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "loss", "distances", "SqrtBackward0", _line("d = torch.sqrt("),
        _molecules_with_coincident_atoms(), "invalid"), rep


def test_a_linear_molecule_names_acos_and_says_to_clamp_or_use_atan2(tmp_path):
    """Carbon dioxide is linear: the cosine of its O-C-O angle is exactly -1, clamp passes
    it, and acos's derivative there is infinite, so the forces of that molecule are NaN.
    The report named AcosBackward0 but advised what fits sqrt ("torch.where(x > 0, x, 1)":
    the pole at 0), which for acos moves nothing; now it says that acos's pole is at +-1 and
    to clamp inside the domain or take the angle with atan2 as DimeNet does."""
    err = _train("linear", tmp_path, angles=True)
    bad = _molecules_with_a_straight_angle()
    assert bad == [BAD]
    assert (err.event["phase"], err.event["samples"]) == ("forward", bad), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["node"], o["node_source"], o["samples"],
            rep["cause"]) == ("forward", "", "aten.rsqrt", "AcosBackward0",
                              _line("angle = torch.acos("), bad, "invalid"), rep
    assert "+-1" in rep["hint"] and "atan2" in rep["hint"], rep["hint"]
    assert "torch.where(x > 0" not in rep["hint"], rep["hint"]


def test_a_validation_forward_names_molecules_not_atoms(tmp_path):
    """Validation under torch.no_grad (the model enables grad for its forces itself) on a set
    holding the molecule with coincident atoms: an evaluation event, checked before any loss
    ran, so no loss target said the batch was of molecules; the atoms (3 tensors of N rows)
    outnumbered them and the samples named were atom rows ([4, 5], past the 5 molecules).
    Now the batch vector's graphs are the samples, in the event and the replay alike."""
    model = M.make_schnet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.EnergyForceLoss()
    (val,) = M.batches("coincident", 0, 1, steps=1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="molecule_models:make_schnet"):
            for z, pos, batch, e, f in M.batches("none", K, BAD):
                model.train()
                opt.zero_grad()
                crit(model(z, pos, batch, len(e)), e, f).backward()
                opt.step()
                model.eval()
                with torch.no_grad():
                    z, pos, batch, e, f = val
                    crit(model(z, pos, batch, len(e)), e, f)
    err = info.value
    pos, batch = val[1], val[2]
    same = (batch[:, None] == batch[None, :]) & ~torch.eye(len(pos), dtype=torch.bool)
    bad = sorted(set(batch[(same & ((pos[:, None] - pos[None, :]) == 0).all(-1)).any(1)].tolist()))
    assert bad == [1]
    assert (err.event["step"], err.event["evaluation"], err.event["samples"]) == (1, True, bad)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["node"], o["samples"], o["batch_size"], rep["cause"]) == (
        "forward", "aten.div", "SqrtBackward0", bad, 5, "invalid"), rep


def test_forces_in_the_wrong_unit_name_the_molecule_and_no_drop(tmp_path):
    """From step 1 molecule 1's forces are in meV/Angstrom among eV/Angstrom: SGD with
    momentum diverges until a product overflows. The forces are one row per atom, so the
    out-of-scale search, which looked along a batch dimension only, did not see them and
    blamed the learning rate alone; now it takes each molecule's largest force through the
    batch vector and names that molecule, and, as no drop can cut a graph from a batch
    concatenated node by node, it says to leave it out of the dataset instead of offering
    ``--try drop=``."""
    model = M.make_schnet()
    opt = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
    crit = M.EnergyForceLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="molecule_models:make_schnet"):
            for z, pos, batch, e, f in M.batches("mev", 1, 1, steps=20):
                opt.zero_grad()
                crit(model(z, pos, batch, len(e)), e, f).backward()
                opt.step()
    err = info.value
    step = err.event["step"]
    *_, (z, pos, batch, e, f) = M.batches("mev", 1, 1, steps=step + 1)
    per = torch.zeros(len(e)).scatter_reduce(0, batch, f.abs().amax(1), "amax")
    out = [k for k in range(len(e)) if per[k] > 10 * max(per[j] for j in range(len(e)) if j != k)]
    assert out == [1]
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    # (a diverging run: the weights grew over the steps, and the overflow spans the batch)
    assert (step, o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        11, "forward", "interactions.0.out.1", "aten.addmm", [0, 1, 2, 3, 4], "overflow"), rep
    assert "sample(s) 1 of loss_args[2] reach" in rep["hint"], rep["hint"]
    assert "leave them out of the dataset" in rep["hint"] and "--try drop" not in rep["hint"]


def test_forces_taken_in_the_loop_name_the_molecule_not_an_atom_count(tmp_path):
    """PyG's MD17 recipe: the loop sets ``pos.requires_grad_()``, takes the forces of the
    model's energy with autograd.grad and calls one MSELoss on the energies, then on the
    forces. The bundle keeps the forces call, (N, 3) against (N, 3): the atoms were taken
    for the batch (batch_size 26) and no sample was named. Now the batch is of the batch
    vector's molecules, and the replay, differentiating the output as the loop did, names
    SqrtBackward0 in ``distances`` on the molecule with coincident atoms."""
    model = M.make_schnet(forces=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mse = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=mse, out_dir=tmp_path,
                            factory="molecule_models:make_schnet",
                            factory_kwargs={"forces": False}) as rec:
            for z, pos, batch, e, f in M.batches("coincident", K, BAD):
                pos.requires_grad_(True)
                opt.zero_grad()
                energy = model(z, pos, batch, len(e))
                forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
                (0.01 * rec.loss_fn(energy, e) + 0.99 * rec.loss_fn(forces, f)).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "loss"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], o["batch_size"],
            rep["cause"]) == ("loss", "distances", "SqrtBackward0", _line("d = torch.sqrt("),
                              _molecules_with_coincident_atoms(), 5, "invalid"), rep
    assert any("the loop computed from the model output's derivatives" in p
               for p in rep["problems"]), rep["problems"]


def _train_schnetpack(out_dir: Path) -> NonFiniteError:
    model = M.make_schnetpack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = M.SchNetPackLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="molecule_models:make_schnetpack"):
            for z, pos, batch, e, f in M.batches("coincident", K, BAD):
                inputs = M.schnetpack_collate(z, pos, batch, e, f)
                targets = {k: inputs[k] for k in ("energy", "forces")}
                opt.zero_grad()
                crit(model(inputs), targets).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "forward")
    return info.value


def test_a_model_writing_its_predictions_into_its_input_dict_is_replayed_as_called(tmp_path):
    """SchNetPack's model writes ``inputs["energy"]`` and ``inputs["forces"]`` into the dict
    it was given (over the labels the collate put there) and returns it. The recorder kept
    that dict by reference, so the bundle's batch held the NaN predictions as inputs, and the
    replay reported an input event on ``batch["forces"]``, "not per sample"; the recorder
    now keeps the call's dicts and lists as they came, and the replay names the forward's
    SqrtBackward0 at the coincident atoms."""
    err = _train_schnetpack(tmp_path)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o.get("node"), o.get("node_source"),
            rep["cause"]) == ("forward", "", "aten.div", "SqrtBackward0",
                              _line("d = torch.sqrt("), "invalid"), rep


def test_a_neighbour_list_beside_the_batch_vector_does_not_hide_the_molecules(tmp_path):
    """SchNetPack's collate puts the neighbour list's centre atoms ``_idx_i`` (sorted: from
    0, never decreasing) before the batch vector ``_idx_m``; both read as assignment vectors,
    and the first was taken, grouping pairs by atom, so no molecule was named. The one with
    the fewest groups is the batch's: the molecule with the coincident atoms."""
    err = _train_schnetpack(tmp_path)
    bad = _molecules_with_coincident_atoms()
    assert err.event["samples"] == bad, err.event
    rep = nanreplay_json(err.bundle_path)
    assert (rep["origin"]["samples"], rep["origin"]["batch_size"]) == (bad, 5), rep["origin"]


def test_a_symmetric_atoms_vector_norm_names_its_molecule_and_an_eps_under_the_root(tmp_path):
    """PaiNN-style vector features trained on energies alone: carbon dioxide's carbon has two
    equal oxygens on opposite sides, so its vector messages cancel and ||v|| is sqrt of 0 in
    float32 (1e-9 or so in float64, whose rounding does not cancel them exactly): the
    backward's SqrtBackward0 is infinite there. Its gradient is one row per atom, which named
    no sample; now the molecule. And the precision hint, which spoke of variances and
    sigmoids only, says to put an eps under the root, as PaiNN does."""
    kw = {"forces": False, "vectors": True}
    model = M.make_schnet(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mse = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=mse, out_dir=tmp_path,
                            factory="molecule_models:make_schnet", factory_kwargs=kw):
            for z, pos, batch, e, _ in M.batches("linear", K, BAD):
                opt.zero_grad()
                mse(model(z, pos, batch, len(e)), e).backward()
                opt.step()
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (K, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "backward", "vectors", "SqrtBackward0", _line("norm = torch.sqrt("),
        _molecules_with_a_straight_angle(), "precision"), rep
    assert "torch.sqrt(x + 1e-8)" in rep["hint"], rep["hint"]
