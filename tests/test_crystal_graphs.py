"""End to end on materials property prediction over crystal graphs (``crystal_graphs_models``):
CGCNN-style gated convolutions over a minimum-image neighbour list inside a cutoff, the bond
lengths expanded in Gaussians (and ALIGNN's bond angles over the line graph's triplets), a per-crystal mean (or attention, or mean-and-std) readout over
the batch vector, formation energy and log10 bulk modulus standardised by the training set's
mean and std inside an L1 loss, trained with AdamW, a cosine schedule and gradient clipping
over a ``DataLoader`` whose ``collate_fn`` joins the crystals into one graph. Each planted
failure fires under the recorder and is replayed with the CLI; the healthy run raises nothing
and trains bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import crystal_graphs_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, BAD = 2, 1  # the step the planted failure is in, and its crystal (of 4)
FACTORY = "crystal_graphs_models:make_cgcnn"


def line_of(text: str) -> str:
    return source_line("crystal_graphs_models.py", text)


def train(plant: str, out_dir, kw: dict | None = None, cutoff: float = M.CUTOFF,
          targets: str = "none", eps: float = 1e-8, record: bool = True) -> torch.nn.Module:
    """CGCNN's recipe, small: AdamW, a cosine schedule, gradient norm clipping, the loss's
    Normalizer fitted on the training targets. Returns the model."""
    kw = kw or {}
    model = M.make_cgcnn(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2, eps=eps)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    crit = M.StandardisedL1(M.Normalizer(M.training_targets(targets)))
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         factory_kwargs=kw)
    with rec if record else contextlib.nullcontext():
        for b in M.loader(plant, K, BAD, cutoff=cutoff):
            opt.zero_grad()
            pred = model(b["z"], b["site"], b["edge_index"], b["dist"], b["batch"],
                         b["n_atoms"], b["vec"], b["triplets"])
            loss = crit(pred, b["y"], b["mask"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
    return model


def fire(plant: str, out_dir, step: int = K, code: int | None = 0, **kw):
    """(event, report) of the planted run, which must raise at ``step``."""
    with pytest.raises(NonFiniteError) as info:
        train(plant, out_dir, **kw)
    ev = info.value.event
    assert ev["step"] == step, ev
    return ev, nanreplay_json(info.value.bundle_path, code=code)


def step_k(plant: str, cutoff: float = M.CUTOFF) -> dict:
    return list(M.loader(plant, K, BAD, cutoff=cutoff))[K]


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["samples"], rep["cause"]


@pytest.mark.parametrize("kw", [{}, {"pool": "mean_std"}, {"pool": "attention"},
                                {"aggregate": "mean", "normalise_rbf": True},
                                {"angles": True}])
def test_healthy_crystals_raise_nothing_and_train_the_same(tmp_path, kw):
    recorded = train("none", tmp_path, kw=kw)
    plain = train("none", tmp_path, kw=kw, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_crystal_with_no_atoms_names_the_mean_pool_and_the_empty_graph(tmp_path):
    """A disordered structure whose partially occupied sites a filter dropped stays in the
    batch with 0 atoms: the mean pool's sum over nothing divided by n_atoms = 0 is 0/0. The
    report had called the divisor a missing value filled with 0 ('fill from the last valid
    value') and left out that the crystal is an empty graph; now it says 0/0, an empty graph,
    filter it or floor n_atoms."""
    assert step_k("empty")["n_atoms"].tolist()[BAD] == 0
    ev, rep = fire("empty", tmp_path)
    assert (ev["phase"], ev["module"], ev["samples"]) == ("forward", "pool", [BAD]), ev
    assert origin(rep) == ("forward", "pool", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("return total / n_atoms[:, None]"), rep
    assert rep["hint"].startswith("aten.div of 0 by 0 (0/0): its divisor is the batch's own "
                                  "data (args[5])"), rep["hint"]
    assert f"Sample(s) {BAD} are empty graphs" in rep["hint"], rep["hint"]
    assert "fill from the last valid value" not in rep["hint"], rep["hint"]


def test_a_one_atom_cell_names_its_isolated_atom_not_the_sampler(tmp_path):
    """bcc Fe's one-atom primitive cell: its only neighbours are its own periodic images, which
    a minimum-image search over the other sites never visits, so the atom has no edge and
    ALIGNN's neighbour mean agg / deg is 0/0 there. The report said the group was one 'no
    element of the batch fell in', 'no record is to blame', and to make the sampler put members
    of every group in each batch; now it names the isolated node of crystal BAD and its
    neighbour list."""
    b = step_k("single")
    assert b["n_atoms"].tolist()[BAD] == 1
    lone = int(torch.nonzero(b["batch"] == BAD))
    assert lone not in b["edge_index"][1].tolist()
    ev, rep = fire("single", tmp_path, kw={"aggregate": "mean"})
    assert (ev["phase"], ev["module"]) == ("forward", "convs.0"), ev
    assert origin(rep) == ("forward", "convs.0", "aten.div", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("agg = agg / deg"), rep
    assert f"0 at row(s) [{lone}], rows of sample(s) [{BAD}]" in rep["hint"], rep["hint"]
    assert "isolated nodes" in rep["hint"] and "neighbour list is to blame" in rep["hint"]
    assert "No record is to blame" not in rep["hint"], rep["hint"]
    assert "make the sampler" not in rep["hint"], rep["hint"]


def test_a_long_bond_past_the_gaussians_names_the_underflow_on_its_crystal(tmp_path):
    """The neighbour list's cutoff raised to 9 Angstrom, the Gaussian expansion's centres left
    at 0-6: a bond of 8.6 Angstrom in one crystal is 25 widths from the last centre, every
    Gaussian underflows to 0 and the soft one-hot's rbf / rbf.sum() is 0/0. The report named
    all four crystals, as only the nodes' rows mapped to graphs, not the edges'; now it names
    the crystal of the bond."""
    b = step_k("long_bond", cutoff=9.0)
    far = b["dist"] > 8.2
    assert sorted(set(b["batch"][b["edge_index"][0][far]].tolist())) == [BAD]
    ev, rep = fire("long_bond", tmp_path, kw={"normalise_rbf": True}, cutoff=9.0)
    assert (ev["phase"], ev["module"]) == ("forward", "rbf"), ev
    assert origin(rep) == ("forward", "rbf", "aten.div", [BAD], "underflow"), rep
    assert rep["origin"]["source"] == line_of("return rbf / rbf.sum(-1, keepdim=True)"), rep


def test_an_attention_readout_over_a_radius_in_picometres_names_the_underflow(tmp_path):
    """One crystal's covalent radii read from a table in picometres (140 for 1.40 Angstrom):
    MEGNet's attention scores on its atoms reach -100, the hand-written per-graph softmax
    exp(s) / index_add(exp(s)) (no max subtracted) has subnormal weights and a subnormal
    denominator, and its backward's 1/denominator² is infinite. The report said precision,
    'rounding put the op's input on its pole' (a numerator's exact 0 read as the pole); now it
    says underflow of values from exp, and names the out-of-scale data of the crystal."""
    site = step_k("pm_radius")["site"]
    assert site[:, 1].abs().max() > 100
    ev, rep = fire("pm_radius", tmp_path, kw={"pool": "attention"})
    assert ev["phase"] == "backward", ev
    assert origin(rep) == ("backward", "pool", "DivBackward0", [BAD], "underflow"), rep
    assert rep["origin"]["source"] == line_of("alpha = w / denom[batch]"), rep
    assert "below its type's smallest normal number" in rep["hint"], rep["hint"]
    assert f"sample(s) {BAD} of args[1]" in rep["hint"] and "out of scale" in rep["hint"]


def test_a_std_readout_over_an_elemental_cell_names_the_variance_of_alike_atoms(tmp_path):
    """A mean-and-std readout, std = sqrt((E[h²] − E[h]²).clamp_min(0)) per crystal by
    index_add_: bcc Fe's two atoms are alike, the variance is exactly 0 and sqrt's derivative
    there is infinite, a NaN of the backward only. The report spoke of a distance between
    two points that coincide; now it says a variance of a graph whose nodes are alike."""
    ev, rep = fire("elemental_pair", tmp_path, kw={"pool": "mean_std"})
    assert ev["phase"] == "backward", ev
    assert origin(rep) == ("backward", "pool", "SqrtBackward0", [BAD], "invalid"), rep
    assert rep["origin"]["source"] == line_of("std = torch.sqrt((mean_sq - mean ** 2)"), rep
    assert "E[x²] − E[x]² clamped at 0" in rep["hint"], rep["hint"]
    assert "two points coincide" not in rep["hint"], rep["hint"]


def test_a_linear_bond_pair_names_the_acos_of_a_cosine_rounded_past_minus_1(tmp_path):
    """ALIGNN's bond angles without its clamp: cuprite's linear O-Cu-O unit has two bonds at
    180 degrees, whose cosine rounds to -1.0000001 in float32, and acos of it is NaN; float64
    rounds it inside the domain, so the cause is precision, with a clamp or atan2 to fix it."""
    ev, rep = fire("linear", tmp_path, kw={"angles": True})
    assert (ev["phase"], ev["module"]) == ("forward", "angles"), ev
    assert origin(rep) == ("forward", "angles", "aten.acos", [BAD], "precision"), rep
    assert rep["origin"]["source"] == line_of("theta = torch.acos(cos)"), rep
    assert "clamp the input into the domain" in rep["hint"] and "atan2" in rep["hint"]


def test_a_negative_bulk_modulus_names_the_nan_target_of_its_crystal(tmp_path):
    """A mechanically unstable crystal's K_VRH is negative (Materials Project holds such
    entries): the collate_fn's log10 makes its target NaN, an input event of the loss."""
    assert torch.isnan(step_k("negative_k")["y"][BAD, 1])
    ev, rep = fire("negative_k", tmp_path)
    assert (ev["phase"], ev["samples"]) == ("input", [BAD]), ev
    o = rep["origin"]
    assert (o["phase"], o["samples"], rep["cause"]) == ("input", [BAD], "input"), rep
    assert "fix the data pipeline for these samples" in rep["hint"], rep["hint"]


def test_a_normalizer_fitted_on_elemental_solids_names_its_zero_std(tmp_path):
    """The Normalizer fitted on a sample of the training set that holds only elemental solids,
    whose formation energy is 0: its std is 0 and the loss's (y - mean) / std is infinite on
    every crystal from the first step."""
    ev, rep = fire("none", tmp_path, step=0, targets="elemental")
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    assert origin(rep) == ("loss", "<loss>", "aten.div", [0, 1, 2, 3], "invalid"), rep
    assert rep["origin"]["source"] == line_of("return (y - self.mean) / self.std"), rep
    assert "the buffer <loss>.normalizer.std as the code keeps it, 0 at entry 0" in rep["hint"]


def test_a_normalizer_fitted_on_one_crystal_names_its_nan_std(tmp_path):
    """The Normalizer fitted on a debug subset of one crystal: torch.std's n - 1 is 0 and the
    std is NaN before the first step; the loss's (y - mean) / std takes it."""
    with pytest.warns(UserWarning, match="degrees of freedom"):
        ev, rep = fire("none", tmp_path, step=0, targets="one")
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>"), ev
    assert origin(rep) == ("loss", "<loss>", "aten.div", [0, 1, 2, 3], "weights"), rep
    assert "the loss's 'normalizer.std' holding nan, nan" in rep["hint"], rep["hint"]
    assert "a target normaliser's std fitted on a single sample" in rep["hint"], rep["hint"]


def test_adamw_with_eps_0_names_the_embedding_rows_of_absent_elements(tmp_path):
    """AdamW with eps=0: the embedding rows of elements no crystal holds have m = v = 0 and
    their update is 0/0 at the first step (the bundle holds the weights after it)."""
    ev, rep = fire("none", tmp_path, step=0, code=None, eps=0.0)
    assert ev["phase"] == "optimizer", ev
    assert (rep["origin"]["phase"], rep["cause"]) == ("optimizer", "optimizer"), rep
    assert "embedding.weight" in rep["hint"] and "with eps=0" in rep["hint"], rep["hint"]
    assert "every one a row whose gradient was all 0" in rep["hint"], rep["hint"]
