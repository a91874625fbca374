"""End to end on machine-learned interatomic potentials (``interatomic_potentials_models``):
NequIP/MACE-style message passing over a neighbour list the data pipeline builds, a Bessel or
Gaussian radial basis under a polynomial or fractional-power envelope, the forces ``-dE/dpos``
and the stress ``dE/dstrain / volume`` from ``autograd.grad(create_graph=True)`` in the
forward, a per-atom energy loss, trained with AMSGrad, ReduceLROnPlateau, gradient clipping
and an EMA of the weights over a ``DataLoader``. Each planted failure of the domain fires under
the recorder at step K in structure BAD and is replayed with the CLI; the healthy run raises
nothing and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import interatomic_potentials_models as M
import molecule_models as Mol
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, BAD = 2, 1  # the step the planted failure is in, and its structure (of 4)
FACTORY = "interatomic_potentials_models:make_potential"


def line_of(text: str) -> str:
    return source_line("interatomic_potentials_models.py", text)


def train(plant: str, out_dir, kw: dict | None = None, stress: bool = False,
          amp: torch.dtype | None = None, record: bool = True) -> torch.nn.Module:
    """MACE's recipe, small: AMSGrad, ReduceLROnPlateau on the training loss, gradient norm
    clipping, an EMA of the weights; autocast where ``amp`` says. Returns the model."""
    kw = kw or {}
    model = M.make_potential(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, amsgrad=True)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    crit = M.WeightedEnergyForcesStressLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         factory_kwargs=kw)
    with rec if record else contextlib.nullcontext():
        for b in M.loader(plant, K, BAD):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = model(b["z"], b["pos"], b["edge_index"], b["batch"], b["n_atoms"],
                            b["cell"], compute_stress=stress)
            extra = (b["stress"], b["stress_weight"]) if stress else ()
            loss = crit(out, b["energy"], b["forces"], b["n_atoms"], *extra)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            ema.update_parameters(model)
            sched.step(loss.item())
    return model


def fire(plant: str, out_dir, **kw):
    """(event, report) of the planted run, which must raise at step K."""
    with pytest.raises(NonFiniteError) as info:
        train(plant, out_dir, **kw)
    ev = info.value.event
    assert ev["step"] == K, ev
    return ev, nanreplay_json(info.value.bundle_path)


def step_k(plant: str) -> dict:
    return list(M.loader(plant, K, BAD))[K]


def test_self_edge_names_the_bessel_basis_0_by_0_in_its_structure(tmp_path):
    """An image search over periodic shifts that forgot the zero shift leaves each atom's pair
    with itself in one structure's neighbour list: its length is 0 and NequIP's Bessel basis
    sin(w r / r_max) / r is 0/0 in the forward. The report said to add an eps or skip the
    rows; now it says the rows are the self-edges of the edge list and to drop them where
    the list is built."""
    b = step_k("self_edge")
    s, r = b["edge_index"]
    assert sorted(set(b["batch"][s[s == r]].tolist())) == [BAD]
    ev, rep = fire("self_edge", tmp_path)
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "basis", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], o["batch_size"],
            rep["cause"]) == ("forward", "basis", "aten.div", line_of("(numerator / r[:, None])"),
                              [BAD], 4, "invalid"), rep
    assert "0 by 0" in rep["hint"], rep["hint"]
    assert "its rows are exactly the self-edges of the edge list args[2]" in rep["hint"]
    assert "args[2][:, args[2][0] != args[2][1]]" in rep["hint"], rep["hint"]


def test_a_duplicated_atom_names_the_positions_not_a_self_edge(tmp_path):
    """Two different atoms of one structure at one position (a format conversion wrote one
    twice): their pair's length is 0 and the Bessel basis is 0/0 on those two edges. The
    report names the positions, args[1], as holding a duplicated node, and not the edge list
    as holding self-edges."""
    b = step_k("coincident")
    s, r = b["edge_index"]
    zero = (b["pos"][s] == b["pos"][r]).all(-1)
    assert bool((s[zero] != r[zero]).all()) and sorted(set(b["batch"][s[zero]].tolist())) == [BAD]
    ev, rep = fire("coincident", tmp_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "forward", "basis", "aten.div", [BAD], "invalid"), rep
    assert "between two different nodes at one position in args[1]" in rep["hint"], rep["hint"]
    assert "self-edges" not in rep["hint"], rep["hint"]


def test_self_edges_in_schnetpacks_index_vectors_are_named_too(tmp_path):
    """SchNetPack's inputs dict carries the neighbour list as two vectors, ``_idx_i`` and
    ``_idx_j``; a neighbour list that kept each atom of molecule 3 paired with itself makes
    DimeNet's Bessel basis 0/0 there. The report names both vectors as the edge ends whose ids
    are equal and to keep the pairs where they differ."""
    kw = {"basis": "bessel"}
    model = Mol.make_schnetpack(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = Mol.SchNetPackLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, factory_kwargs=kw,
                            factory="molecule_models:make_schnetpack"):
            for step, (z, pos, batch, e, f) in enumerate(Mol.batches("none", K, 3)):
                inputs = Mol.schnetpack_collate(z, pos, batch, e, f)
                if step == K:  # (molecule 3's atoms, each its own neighbour)
                    atoms = torch.nonzero(batch == 3).flatten()
                    inputs["_idx_i"] = torch.cat([inputs["_idx_i"], atoms])
                    inputs["_idx_j"] = torch.cat([inputs["_idx_j"], atoms])
                opt.zero_grad()
                crit(model(inputs), {k: inputs[k] for k in ("energy", "forces")}).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["samples"]) == (K, [3]), info.value.event
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "rbf", "aten.div", [3], "invalid"), rep
    assert 'self-edges of the edge ends batch["_idx_i"] and batch["_idx_j"]' in rep["hint"]
    assert 'keep = batch["_idx_i"] != batch["_idx_j"]' in rep["hint"], rep["hint"]


def test_a_where_guarded_bessel_basis_names_the_dropped_0_by_0_and_the_double_where(tmp_path):
    """The same self-edge under a basis "made safe" by its limit at r = 0,
    torch.where(r > 0, sin(w r) / r, w): the energy is finite, but the forces' autograd.grad
    runs DivBackward0 through the dropped branch, 0 times 0/0. The report named the div and
    said to skip the rows where r is 0, which the where already does; now it says the
    forward dropped that NaN, the derivative still runs it, and to make the input safe
    before the op (the double where)."""
    ev, rep = fire("self_edge", tmp_path, kw={"basis": "sinc_limit"})
    assert (ev["phase"], ev["samples"]) == ("forward", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "basis", "aten.div", line_of("safe = torch.where(rr > 0, numerator / rr"),
        [BAD], "invalid"), rep
    assert "the forward dropped that NaN before 'basis' returned" in rep["hint"], rep["hint"]
    assert "the double where" in rep["hint"], rep["hint"]
    assert "skip the rows where it is 0" not in rep["hint"], rep["hint"]
    assert "self-edges of the edge list args[2]" in rep["hint"], rep["hint"]


def test_a_structure_with_no_atoms_names_the_per_atom_energy_and_the_empty_graph(tmp_path):
    """A frame whose atoms a filter removed stays in the batch as a structure of 0 atoms: its
    energy is a sum over nothing and the per-atom error (pred - e) / n_atoms is 0/0. The
    report said to add an eps; now it also says the structure has no node in the batch
    vector, to filter it where the data is made or to floor n_atoms."""
    b = step_k("empty")
    assert torch.nonzero(b["n_atoms"] == 0).flatten().tolist() == [BAD]
    ev, rep = fire("empty", tmp_path)
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "loss", "<loss>", "aten.div", line_of("e = ((pred[\"energy\"] - energy) / n_atoms)"),
        [BAD], "invalid"), rep
    assert f"Sample(s) {BAD} are empty graphs" in rep["hint"], rep["hint"]
    assert "n_atoms.clamp_min(1)" in rep["hint"], rep["hint"]


def test_a_stale_neighbour_list_names_the_fractional_power_of_the_envelope(tmp_path):
    """An MD frame's neighbour list, built with a skin and not rebuilt after an atom moved far:
    a pair past r_max reaches the envelope (1 - (r / r_max)^2)^1.5, a negative base to a
    fractional power, whose NaN the mask's * 0 keeps."""
    b = step_k("stale")
    s, r = b["edge_index"]
    far = (b["pos"][s] - b["pos"][r]).norm(dim=-1) > M.R_MAX
    assert sorted(set(b["batch"][s[far]].tolist())) == [BAD]
    ev, rep = fire("stale", tmp_path, kw={"cutoff": "smooth"})
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "cutoff", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "cutoff", "aten.pow", line_of("return (1.0 - (r / self.r_max) ** 2) ** 1.5"),
        [BAD], "invalid"), rep
    assert "negative number to a fractional power" in rep["hint"], rep["hint"]
    assert "clamp_min(0)" in rep["hint"], rep["hint"]


def test_stress_of_a_molecule_among_crystals_names_the_volume_and_no_counts(tmp_path):
    """MACE's stress, virials / volume, over a batch of crystals holding one molecule (cell of
    zeros, volume 0, stress weight 0): x/0 in that structure. The hint had added that the
    structure "holds no counts" (a cell with no UMIs) and to filter it by min_counts QC, as
    the cell matrix, 0 there and non-negative elsewhere, read as counts; counts are integers
    and lattice constants are not, so the hint keeps to the pole."""
    b = step_k("molecule")
    assert torch.nonzero(torch.linalg.det(b["cell"]) == 0).flatten().tolist() == [BAD]
    ev, rep = fire("molecule", tmp_path, stress=True)
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "", "aten.div", line_of('out["stress"] = grads[1] / volume'), [BAD],
        "invalid"), rep
    assert "by 0 (x/0" in rep["hint"] and "skip the rows where it is 0" in rep["hint"]
    assert "hold no counts" not in rep["hint"] and "min_counts" not in rep["hint"], rep["hint"]


def test_maces_stress_guard_leaves_the_molecules_0_volume_to_the_backward(tmp_path):
    """MACE's guard, torch.where(|stress| < 1e10, stress, 0), keeps the molecule's stress
    finite in the forward, but the loss's backward runs DivBackward0 of the where's 0
    gradient by the volume 0: 0/0 in the parameters' gradients. The report names that node
    on the stress's line, the molecule, and the double where."""
    kw = {"stress_guard": True}
    ev, rep = fire("molecule", tmp_path, kw=kw, stress=True)
    assert ev["phase"] == "backward", ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "backward", "", "DivBackward0", line_of('out["stress"] = grads[1] / volume'), [BAD],
        "invalid"), rep
    assert "still sends the gradient through both branches" in rep["hint"], rep["hint"]
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_float16_repulsion_of_a_close_pair_names_the_cast_and_overflow(tmp_path):
    """Under float16 autocast the learned (sigma / r)^12 repulsion of two atoms 0.1 Angstrom
    apart is 2e10 in float32, cast to float16 where the atomic energies are: +inf, and the
    forces' backward through the float16 sigma head makes NaN of it. The hint had replaced
    the overflow's advice with the story of an infinity a torch.where dropped (the forces'
    double where), though the energy the model returned held it; now it says to keep the op
    in float32."""
    b = step_k("close")
    pos, batch = b["pos"], b["batch"]
    d = torch.cdist(pos, pos) + torch.eye(len(pos)) * 9
    close = (d < 0.2) & (batch[:, None] == batch[None, :])
    assert sorted(set(batch[close.any(1)].tolist())) == [BAD]
    ev, rep = fire("close", tmp_path, kw={"repulsion": True}, amp=torch.float16)
    assert (ev["phase"], ev["samples"]) == ("forward", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "", "aten._to_copy", line_of("self.repulsion(h, lengths, edge_index)"),
        [BAD], "overflow"), rep
    assert "beyond float16's largest value" in rep["hint"], rep["hint"]
    assert "compute this op in float32" in rep["hint"], rep["hint"]
    assert "dropped" not in rep["hint"] and "double where" not in rep["hint"], rep["hint"]


def test_avg_num_neighbors_of_0_names_the_setting_not_the_data(tmp_path):
    """MACE's avg_num_neighbors, computed from the training set with the cutoff in nm (0.4)
    where the positions are in Angstrom, is 0: every message sum is divided by 0 at step 0.
    The report names the division in the first interaction, every structure, and the
    setting, a Python number, as what to fix (not an eps in the data)."""
    avg = M.avg_num_neighbors(M.dataset("none", K, BAD), 0.4)
    assert avg == 0.0
    with pytest.raises(NonFiniteError) as info:
        train("none", tmp_path, kw={"avg_num_neighbors": avg})
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "interactions.0"), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "interactions.0", "aten.div", line_of("/ self.avg_num_neighbors"),
        [0, 1, 2, 3], "invalid"), rep
    assert "the divisor is a Python number" in rep["hint"], rep["hint"]
    assert "find the setting that made it 0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("plant,kw,stress,amp", [
    ("none", {}, False, None), ("crystals", {"basis": "gaussian"}, True, None),
    ("none", {"repulsion": True}, False, torch.bfloat16), ("stale", {}, False, None)])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, plant, kw, stress, amp):
    """No planted failure (crystals only where the stress is trained: every volume > 0): no
    event, and the weights after four steps of AMSGrad with the plateau schedule and clipping
    equal, bit for bit, those of the same run without the recorder (the forces' double
    backward included); under bfloat16 autocast the repulsion's (sigma / r)^12 of atoms 0.8
    Angstrom or more apart stays finite; a stale neighbour list under NequIP's polynomial
    envelope (integer powers, masked past r_max) gives its far pair a weight of 0, no NaN."""
    with_rec = train(plant, tmp_path, kw=kw, stress=stress, amp=amp)
    without = train(plant, tmp_path, kw=kw, stress=stress, amp=amp, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), (_, b) in zip(with_rec.state_dict().items(), without.state_dict().items()):
        assert torch.equal(a, b), name
