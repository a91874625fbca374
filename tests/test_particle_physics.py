"""End to end on high-energy-physics jet models (``particle_physics_models``): ParticleNet's
EdgeConv over a kNN graph in (eta, phi) and a Particle Transformer with pairwise interaction
features, both on jets padded by a DataLoader's ``collate_fn`` and trained with a
cross-entropy weighted by signed generator weights and class weights, under gradient clipping;
a jet four-momentum regression under a log-cosh loss and a signed-mass term; a RealNVP
calorimeter-shower flow on CaloFlow's logit preprocessing. Each planted failure of the domain
fires under the recorder and is replayed with the CLI; the healthy versions raise no event and
train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import particle_physics_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("particle_physics_models.py", text)


def jets(bad: dict | None = None, steps: int = 3, n: int = 8) -> DataLoader:
    """Jets from a DataLoader padded by ``collate_jets``; ``bad`` (see ``make_jets``) in the
    last batch only."""
    g = torch.Generator().manual_seed(0)
    data = []
    for step in range(steps):
        data += M.make_jets(g, n, first=step * n, bad=bad if step == steps - 1 else None)
    return DataLoader(data, batch_size=n, shuffle=False, collate_fn=M.collate_jets)


def train_tagger(make: str, crit, out_dir, bad: dict | None = None, steps: int = 3,
                 record: bool = True, accumulate: int = 1, amp: bool = False):
    """AdamW, gradient clipping, optionally micro-batches and bf16 autocast, as jet taggers
    train; the loss takes the logits, labels and generator weights."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"particle_physics_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for v, mask, labels, weights, _ in jets(bad, steps):
            opt.zero_grad()
            for part in range(accumulate):
                sl = slice(part, None, accumulate)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    logits = model(v[sl], mask[sl])
                loss = loss_fn(logits.float(), labels[sl], weights[sl]) / accumulate
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
    return model


def train_regressor(crit, out_dir, mass: bool = False, steps: int = 3):
    """Adam on the corrected jet four-momentum: the energy alone (``crit(E_pred, E)``) or the
    energy and the mass against the uncorrected jet (``crit(p4, E, p4_raw)``)."""
    model = M.make_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="particle_physics_models:make_regressor") as rec:
        for v, mask, _, _, energy in jets(steps=steps):
            opt.zero_grad()
            pred = model(v, mask)
            args = (pred, energy, v.sum(-1)) if mass else (pred[:, 3], energy)
            rec.loss_fn(*args).backward()
            opt.step()


def train_flow(make: str, crit, out_dir, steps: int = 3, alpha: float = 1e-6,
               dead: int | None = None, sgd_lr: float | None = None):
    """A shower flow on preprocessed voxels: Adam, or SGD with momentum at ``sgd_lr``;
    ``dead``: a voxel with no deposit in any shower of the last batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if sgd_lr is None else \
        torch.optim.SGD(model.parameters(), lr=sgd_lr, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"particle_physics_models:{make}") as rec:
        for step in range(steps):
            shower, e_inc = M.shower_batch(g, empty_voxel=dead if step == steps - 1 else None)
            loss = rec.loss_fn(model(M.logit_preprocess(shower, e_inc, alpha), e_inc))
            opt.zero_grad()
            loss.backward()
            opt.step()


def fired(fn, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kwargs)
    return info.value.event, nanreplay_json(info.value.bundle_path)


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def test_log_pt_of_the_padded_particles_names_the_log_and_the_padding_mask(tmp_path):
    """``log(pT)`` taken of every particle slot, then multiplied by the particle mask: the
    padded slots' 0 makes -inf, and -inf * 0 is NaN, in every jet with padding (all but jets
    0 and 1, which fill the 12 slots). The replay names the log on its line at those jets and
    says the 0s are the collate_fn's padding by the mask the model is given (args[1]), not bad
    records: keep the padding out of the op."""
    ev, rep = fired(train_tagger, "make_particlenet_unsafe_log", M.WeightedCE(), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev
    assert origin_of(rep) == (True, "forward", "", "aten.log", "-inf", [2, 3, 4, 5, 6, 7])
    assert rep["origin"]["source"] == line_of("logs = [torch.log(pt), torch.log(e)]")
    assert rep["cause"] == "invalid", rep
    assert "every such entry is padding by args[1]" in rep["hint"], rep["hint"]
    assert "is a bad record" not in rep["hint"], rep["hint"]


def test_pair_mass_squared_rounded_below_zero_is_precision_and_says_clamp(tmp_path):
    """ParT's ``ln m^2`` of each pair's summed four-momentum without its clamp: for massless
    particles (each with itself, collinear pairs) ``E^2 - px^2 - py^2 - pz^2`` is 0 in exact
    arithmetic and rounds below 0, so the log is NaN in every jet. The float64 re-run of the
    float32 four-momenta crosses 0 too; the replay still says precision (a difference of
    terms of ~E^2 that agree to within rounding) and to clamp m^2 before the log."""
    ev, rep = fired(train_tagger, "make_part_unclamped", M.WeightedCE(), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "forward"), ev
    assert origin_of(rep) == (True, "forward", "", "aten.log", "nan", list(range(8)))
    assert rep["origin"]["source"] == line_of("lnm2 = torch.log(m2.clamp(min=eps) if")
    assert rep["cause"] == "precision", rep
    assert "agree to within rounding" in rep["hint"] and "m2.clamp_min" in rep["hint"]


def test_nan_pz_of_a_track_in_the_last_batch_is_an_input_event_at_that_jet(tmp_path):
    """Jet 19 (the last batch's row 3) holds a track with a NaN pz: the recorder stops at the
    batch, and the replay blames that jet's record."""
    ev, rep = fired(train_tagger, "make_particlenet", M.WeightedCE(), tmp_path,
                    bad={"nan": 19})
    assert (ev["step"], ev["phase"], ev["tensor"]) == (2, "input", "args[0]"), ev
    assert origin_of(rep)[:2] == (True, "input") and rep["origin"]["samples"] == [3], rep
    assert rep["cause"] == "input", rep


def test_jet_with_no_particle_past_the_cuts_names_the_jet_axis_and_the_empty_record(tmp_path):
    """Jet 21 (the last batch's row 5) kept no particle after the selection cuts: its mask is
    all 0 and the pT-weighted jet axis is 0/0. The replay names that division at that jet and
    calls it an empty record of the mask the model is given, to filter where the data is
    made."""
    ev, rep = fired(train_tagger, "make_particlenet", M.WeightedCE(), tmp_path,
                    bad={"empty": 21})
    assert (ev["step"], ev["phase"]) == (2, "forward"), ev
    assert origin_of(rep) == (True, "forward", "", "aten.div", "nan", [5]), rep["origin"]
    assert rep["origin"]["source"] == line_of("axis_eta = (w * eta).sum(-1, keepdim=True)")
    assert rep["cause"] == "invalid", rep
    assert "Sample(s) 5 are empty records: args[1]" in rep["hint"], rep["hint"]


def test_generator_weights_summing_to_zero_name_the_signed_total_not_a_clamp(tmp_path):
    """NLO weights of +1 and -1, normalised by the batch's sum: a batch with four of each
    sums to exactly 0 and the loss is inf. The replay names the division with no sample to
    blame and, the divisor being a total of values of both signs, advises a normaliser that
    cannot cancel rather than count.clamp_min(1)."""
    ev, rep = fired(train_tagger, "make_particlenet", M.WeightedCE(norm="sum"), tmp_path,
                    bad={"weights": [1, -1] * 4})
    assert (ev["step"], ev["phase"]) == (2, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.div", "+inf", []), rep["origin"]
    assert rep["origin"]["source"] == line_of("return (weights * ce).sum() / weights.sum()")
    assert rep["cause"] == "invalid", rep
    assert "values of both signs" in rep["hint"] and "sum of |w|" in rep["hint"], rep["hint"]
    assert "count.clamp_min(1)" not in rep["hint"], rep["hint"]


def test_log_cosh_of_an_energy_residual_in_gev_overflows_cosh(tmp_path):
    """The log-cosh written from its definition on energies in GeV: jet 1's residual is past
    89, cosh overflows float32 and the loss is inf. The replay names cosh at that jet, an
    overflow, and the log-cosh written without it."""
    ev, rep = fired(train_regressor, M.log_cosh, tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.cosh", "+inf", [1]), rep["origin"]
    assert rep["origin"]["source"] == line_of("return torch.log(torch.cosh(pred - target))")
    assert rep["cause"] == "overflow", rep
    assert "log(cosh(x)) = x.abs() + log1p(exp(-2 * x.abs()))" in rep["hint"], rep["hint"]


def test_signed_mass_under_torch_where_is_a_backward_nan_of_the_dropped_sqrt(tmp_path):
    """The mass term's ``where(m2 >= 0, sqrt(m2), -sqrt(-m2))``: the forward is finite, but
    the branch each jet drops is NaN and its sqrt's backward multiplies the where's 0 by it.
    The replay names SqrtBackward0 in the loss on the signed mass's line, at every jet (jets
    0 and 1 are space-like: their NaN is the other sqrt node's, on the same line), and says to
    make the input safe before the op."""
    ev, rep = fired(train_regressor, M.EnergyMassLoss(), tmp_path, mass=True)
    assert (ev["step"], ev["phase"]) == (0, "backward"), ev
    assert origin_of(rep) == (True, "backward", "<loss>", "SqrtBackward0", "nan",
                              list(range(8))), rep["origin"]
    assert rep["origin"]["source"] == line_of("return torch.where(m2 >= 0, torch.sqrt(m2)")
    assert rep["cause"] == "invalid", rep
    assert "torch.where and masked_fill still send the gradient" in rep["hint"], rep["hint"]


def test_flow_density_of_a_dead_cell_shower_underflows_in_the_log_backward(tmp_path):
    """A dead calorimeter cell under a preprocessing alpha of 1e-12 puts the voxel's logit at
    -27.6; the NLL written as ``log(exp(-z^2 / 2) / sqrt(2 pi))`` underflows to a subnormal
    density in shower 3, whose log's derivative overflows. The replay names LogBackward0 on
    that line, an underflow, and the log-space form."""
    ev, rep = fired(train_flow, "make_flow", M.flow_nll, tmp_path, alpha=1e-12, dead=7)
    assert (ev["step"], ev["phase"]) == (2, "backward"), ev
    assert origin_of(rep) == (True, "backward", "<loss>", "LogBackward0", "-inf", [3])
    assert rep["origin"]["source"] == line_of("return -(torch.log(density).sum(-1)")
    assert rep["cause"] == "underflow", rep
    assert "compute in log space" in rep["hint"], rep["hint"]


def test_unbounded_coupling_scale_after_a_large_sgd_step_overflows_exp(tmp_path):
    """The coupling's ``exp(s)`` without the tanh bound, trained with SGD at 0.05 from an NLL
    of 230: the first update throws the weights far, and at step 1 the third coupling's exp
    overflows in every shower. The replay names it, an overflow, and the jump in the weights
    (a diverging run: lower the learning rate or clip)."""
    ev, rep = fired(train_flow, "make_flow_unbounded", M.flow_nll_stable, tmp_path,
                    sgd_lr=0.05, steps=4)
    assert (ev["step"], ev["phase"]) == (1, "forward"), ev
    assert origin_of(rep) == (True, "forward", "layers.2", "aten.exp", "+inf", list(range(8)))
    assert rep["origin"]["source"] == line_of("b = b * torch.exp(s) + t")
    assert rep["cause"] == "overflow", rep
    assert "the weights had jumped in the update before step 1" in rep["hint"], rep["hint"]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values()))


@pytest.mark.parametrize("make, amp", [("make_particlenet", False), ("make_part", True)])
def test_healthy_taggers_train_bit_identically_with_and_without_the_recorder(tmp_path, make,
                                                                            amp):
    """The clamped logs and m^2, per-jet weights averaged over the batch (the balanced batch
    of +-1 weights too), two micro-batches a step, ParT under bf16 autocast: no event, and the
    recorder changes nothing."""
    kw = {"bad": {"weights": [1, -1] * 4}, "steps": 3, "accumulate": 2, "amp": amp}
    recorded = train_tagger(make, M.WeightedCE(), tmp_path, **kw)
    plain = train_tagger(make, M.WeightedCE(), tmp_path, record=False, **kw)
    assert same_weights(recorded, plain)
    assert not list(tmp_path.glob("*.nan"))


def test_healthy_flow_and_regressor_raise_no_event(tmp_path):
    train_flow("make_flow", M.flow_nll_stable, tmp_path, alpha=1e-12, dead=7)
    train_regressor(M.log_cosh_stable, tmp_path)
    assert not list(tmp_path.glob("*.nan"))


def test_only_a_mask_laid_out_as_trailing_padding_is_a_padding_mask():
    """A 0/1 tensor whose 0s end each row is padding; scattered 0s (a nodata mask) are not,
    nor an all-ones mask; a 0 at an entry the mask keeps is not padding's."""
    from replay.padded_zeros import padding_mask, padding_masks

    pad = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    nodata = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    masks = padding_masks({"pad": pad[:, None], "nodata": nodata, "ones": torch.ones(2, 3)})
    assert [name for name, _ in masks] == ["pad"]
    at = torch.tensor([[False, False, True], [False, True, True]])
    assert padding_mask(at, masks) == "pad"
    assert padding_mask(torch.tensor([[True, False, False], [False, False, False]]),
                        masks) is None


def test_a_total_of_values_of_one_sign_is_no_signed_total():
    """Only a sum over data holding both signs is watched: counts or |w| that sum to 0 keep
    the count advice."""
    from replay.signed_total import SignedTotals

    for w, found in ((torch.tensor([1.0, -1.0]), "aten.div"), (torch.zeros(2), None)):
        watch = SignedTotals()
        total = w.sum()
        watch.track("sum.default", (w,), total)
        watch.track("div.Tensor", (torch.tensor(1.0), total), torch.tensor(1.0) / total)
        assert watch.found == found
