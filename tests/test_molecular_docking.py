"""End to end on protein-ligand docking (``molecular_docking_models``): a pose scorer over
``torch.cdist`` of ligand and pocket coordinates with a learned Lennard-Jones 12-6 term, a
bond angle by ``acos`` of normalised bond vectors, message passing with a distance cutoff
averaged over each atom's neighbours, trained on pKd labels with a censored MSE by AdamW with
gradient clipping over a ``DataLoader``. Each planted failure fires under the recorder at step
K in complex BAD and is replayed with the CLI; the healthy run raises nothing and trains
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import molecular_docking_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, BAD = 2, 1
FACTORY = "molecular_docking_models:make_scorer"


def line_of(text: str) -> str:
    return source_line("molecular_docking_models.py", text)


def train(plant: str, out_dir, kw: dict | None = None, record: bool = True,
          kd: bool = False, adam_eps: float = 1e-8) -> torch.nn.Module:
    """AdamW with gradient clipping; ``kd``: the loss takes the measured Kd (nM) as label;
    the element types are passed to forward by keyword."""
    kw = kw or {}
    model = M.make_scorer(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=adam_eps)
    crit = M.CensoredMSE()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=FACTORY,
                         factory_kwargs=kw)
    with rec if record else contextlib.nullcontext():
        for b in M.loader(plant, K, BAD):
            opt.zero_grad()
            pred = model(b["lig_pos"], b["prot_pos"], b["lig_feat"], b["prot_feat"],
                         b["lig_mask"], b["torsion"], lig_type=b["lig_type"])
            loss = crit(pred, b["pkd"], b["censored"], b["kd_nm"] if kd else None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def fire(plant: str, out_dir, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(plant, out_dir, **kw)
    ev = info.value.event
    assert ev["step"] == K, ev
    return ev, nanreplay_json(info.value.bundle_path)


def origin(rep: dict) -> tuple:
    o = rep["origin"]
    return o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]


def test_nan_coordinates_from_a_bad_sdf_parse_are_an_input_event(tmp_path):
    """A ligand coordinate the SDF parser left as NaN: an input event on that complex."""
    ev, rep = fire("nan_coords", tmp_path)
    assert (ev["phase"], ev["samples"]) == ("input", [BAD]), ev
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [BAD]), rep
    assert "data pipeline" in rep["hint"]


def test_an_atom_on_a_pocket_atom_is_the_lennard_jones_pole(tmp_path):
    """A ligand atom placed exactly on a pocket atom: its cdist distance is 0 and the 12-6
    term's sigma / r is +inf (then inf - inf = NaN). The hint said the divisor was a value of
    the data like a diffusion time t = 0 or a duplicated timestamp's dt; now it names the two
    coordinate inputs whose points coincide exactly at the NaN pairs, and to drop or repair
    those records (or floor the distance)."""
    ev, rep = fire("overlap", tmp_path)
    assert origin(rep) == ("forward", "lj", "aten.div", line_of("x = sigma / d"), [BAD],
                           "invalid"), rep
    assert "by 0" in rep["hint"], rep["hint"]
    assert "exactly the pairs of points at one position in args[0] and args[1]" in rep["hint"]
    assert "diffusion time" not in rep["hint"], rep["hint"]


def test_a_straight_angle_rounds_its_cosine_past_minus_one(tmp_path):
    """Three collinear atoms: the normalised bond vectors' dot rounds to -1.0000002 and acos
    is NaN; the cause is rounding (float64 has -1), the hint says clamp or atan2."""
    ev, rep = fire("straight", tmp_path, kw={"angle_clamp": False})
    assert origin(rep) == ("forward", "angle", "aten.acos", line_of("theta = torch.acos(cos)"),
                           [BAD], "precision"), rep
    assert "clamp" in rep["hint"] and "atan2" in rep["hint"], rep["hint"]


def test_a_ligand_out_of_its_pocket_has_no_neighbour_in_the_cutoff(tmp_path):
    """A ligand 50 A from its pocket (a wrong frame): no pocket atom within the cutoff, and
    the neighbour mean is 0/0 under an eps of 0."""
    ev, rep = fire("far", tmp_path, kw={"msg_eps": 0.0})
    assert origin(rep) == ("forward", "messages", "aten.div",
                           line_of("return h_lig + msg / (count + self.eps)"), [BAD],
                           "invalid"), rep
    assert "0 by 0" in rep["hint"] and "exactly 0" in rep["hint"], rep["hint"]


def test_a_clash_overflows_r_minus_12_in_float16(tmp_path):
    """A clash 0.3 A from a pocket atom with pair energies kept in float16: (sigma/r)^12
    passes 65504."""
    ev, rep = fire("close", tmp_path, kw={"lj_half": True})
    assert origin(rep) == ("forward", "lj", "aten.pow",
                           line_of("return (eps * (x ** 12 - 2.0 * x ** 6)).float()"), [BAD],
                           "overflow"), rep
    assert "float16" in rep["hint"] and "float32" in rep["hint"], rep["hint"]


def test_pose_refinement_through_an_unsafe_sqrt_is_named_in_its_derivative(tmp_path):
    """The pose optimisation inner loop differentiates the intra-ligand energy w.r.t. the
    coordinates (create_graph) through sqrt of squared distances whose diagonal is 0: the
    forward is finite but SqrtBackward0's 0/0 makes the inner gradient NaN at step 0 in every
    complex. The report names the root module (""), the sqrt's line, the autograd.grad that ran it and the
    diagonal of the pairwise matrix."""
    with pytest.raises(NonFiniteError) as info:
        train("", tmp_path, kw={"intra_safe": False, "refine_steps": 1})
    assert info.value.event["step"] == 0, info.value.event
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "forward", "", "aten.div",
        line_of("(g,) = torch.autograd.grad(energy, pos, create_graph=True)"), [0, 1, 2, 3],
        "invalid"), rep
    assert "SqrtBackward0" in rep["hint"] and "d = sq.sqrt()" in rep["hint"], rep["hint"]
    assert "the diagonal of a square pairwise matrix" in rep["hint"], rep["hint"]


def test_soft_neighbour_weights_underflow_far_from_the_pocket(tmp_path):
    """Gaussian neighbour weights exp(-d^2 / 8) normalised by their sum: a ligand ~86 A from
    its pocket underflows every weight of its atoms' rows, 0/0. The cause is underflow, the
    hint says softmax (subtract the max) and names the out-of-scale sample."""
    ev, rep = fire("far", tmp_path, kw={"soft": True})
    assert origin(rep) == ("forward", "messages", "aten.div",
                           line_of("w = w / w.sum(2, keepdim=True)"), [BAD], "underflow"), rep
    assert "torch.softmax" in rep["hint"] and "sample(s) 1 of args[0]" in rep["hint"]


def test_a_kd_of_zero_is_a_log_pole_in_the_loss(tmp_path):
    """The loss converts the measured Kd (nM) to pKd = 9 - log10(Kd); an assay's "below
    detection" written as 0 is log10(0) = -inf in the loss, on that complex's label."""
    ev, rep = fire("kd_zero", tmp_path, kd=True)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["source"], o["samples"], rep["cause"]) == (
        "loss", "aten.log10", line_of("pkd = 9.0 - torch.log10(kd_nm)"), [BAD], "invalid"), rep
    assert "loss_args[3] is 0 everywhere in sample(s) 1" in rep["hint"], rep["hint"]


def test_adamw_with_eps_0_makes_unused_element_types_nan(tmp_path):
    """AdamW(eps=0): the element-type embedding's rows of types no complex holds get a
    gradient of exactly 0, m = v = 0, and the update is 0/0 at step 0. The report names the
    optimizer, the parameter and eps."""
    with pytest.raises(NonFiniteError) as info:
        train("", tmp_path, adam_eps=0.0)
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "optimizer")
    rep = nanreplay_json(info.value.bundle_path, code=1)  # (not re-run: weights after it)
    assert (rep["origin"]["phase"], rep["origin"]["param"], rep["cause"]) == (
        "optimizer", "types.weight", "optimizer"), rep
    assert "eps=0" in rep["hint"] and "set eps > 0" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kw, kd", [({}, False), ({"refine_steps": 1}, False),
                                   ({"soft": True}, True)])
def test_healthy_run_raises_nothing_and_trains_the_same(tmp_path, kw, kd):
    """No plant (also with the pose refinement, the soft neighbourhood and Kd labels): no event, the
    weights after four AdamW steps with clipping equal those of the run without the
    recorder, bit for bit."""
    with_rec = train("", tmp_path, kw=kw, kd=kd)
    without = train("", tmp_path, kw=kw, record=False, kd=kd)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), (_, b) in zip(with_rec.state_dict().items(), without.state_dict().items()):
        assert torch.equal(a, b), name
