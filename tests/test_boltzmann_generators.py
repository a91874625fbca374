"""End to end on Boltzmann generators (``boltzmann_generators_models``): a RealNVP flow
trained by reverse KL against a Lennard-Jones cluster's energy (bgflow's linlogcut), by
maximum likelihood on MD frames, and by self-normalised importance weights at an annealed
temperature on the paper's double well. Each planted bug of the domain fires under the
recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import math

import boltzmann_generators_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("boltzmann_generators_models.py", text)


def make_loss(kind: str, variant: str):
    if kind == "bg":
        return M.EnergyKL()
    if kind == "spline":
        return M.DoubleWellKL()
    if kind == "kl":
        return M.ReverseKL(variant.removesuffix("_raw"), cut=not variant.endswith("_raw"))
    if kind == "ml":
        return M.MaxLikelihood()
    if kind == "reweighted_ml":
        return M.ReweightedML()
    return M.ReweightedKL(log_space=variant == "log_space")


BETAS = [1.0, 4.0, 12.0, 30.0]  # the annealing schedule of the reweighted runs


def train(kind: str, make: str, out_dir, variant: str = "", bad: int | None = None,
          steps: int = 4, record: bool = True):
    """Adam with an exponential schedule and gradient clipping, as bgflow's examples train;
    ``bad`` is planted in the last step's MD frames. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    crit = make_loss(kind, variant)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"boltzmann_generators_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            if kind in ("ml", "reweighted_ml"):
                x = M.md_frames(g, bad if step == steps - 1 else None,
                                duplicate=kind == "reweighted_ml")
                z, logdet = model(x, inverse=True)
                loss = loss_fn(z, logdet, *([x] if kind == "reweighted_ml" else []))
            elif kind == "bg":
                x, logdet, u = model(M.latent_batch(g))
                loss = loss_fn(x, logdet, u)
            elif kind == "spline":
                x, logdet = model(M.latent_batch(g))
                loss = loss_fn(x, logdet)
            else:
                z = M.latent_batch(g)
                x, logdet = model(z)
                if kind == "reweighted":
                    crit.beta = BETAS[step]
                    loss = loss_fn(x, logdet, z)
                else:
                    loss = loss_fn(x, logdet)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
    return model


def fire(kind: str, make: str, tmp_path, variant: str = "", bad: int | None = None):
    with pytest.raises(NonFiniteError) as info:
        train(kind, make, tmp_path, variant, bad)
    return info.value.event, info.value.bundle_path


def test_lj_diagonal_masked_by_a_product_names_the_division_by_a_self_distance(tmp_path):
    """The pair energy over ``torch.cdist(pos, pos)`` with the diagonal 'masked' by a product
    with ``1 - eye``: ``sigma / r`` is +inf at r = 0, ``inf - inf`` NaN, and ``NaN * 0`` NaN
    in every configuration's energy; bgflow's linlogcut then caps the NaN at its maximum (a
    where), so the loss is finite and the NaN arrives in the backward of linlogcut's log.
    The replay used to stop at that LogBackward0 ('the op ran outside its domain in a branch
    masked before the output'), sending the user to linlogcut; it now names the loss op that
    made the value the node saved: the reciprocal of the diagonal's 0, on every row, with the
    advice to make the divisor safe before the op."""
    ev, bundle = fire("kl", "make_flow", tmp_path, "cdist_masked")
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["all_samples"]) == (
        True, "<loss>", "LogBackward0", True), o
    assert o["source"] == line_of("u = torch.where(u < high, u, high + torch.log(u - high"), o
    first = o["chain"][0]
    assert (first["op"], first["made"], first["input_min"]) == ("aten.reciprocal", "+inf", 0), o
    assert first["source"] == line_of("return 4 * self.eps * ((self.sigma / r) ** 12"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "made by aten.reciprocal" in rep["hint"] and "1/0" in rep["hint"], rep["hint"]
    assert "diagonal of a square pairwise matrix" in rep["hint"], rep["hint"]
    assert "torch.triu_indices(n, n, 1)" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,variant", [("kl", "make_flow", "cdist_masked_raw"),
                                               ("bg", "make_bg_masked", "")])
def test_lj_self_distance_without_the_cut_names_the_reciprocal_and_the_diagonal(
        tmp_path, kind, make, variant):
    """The same pair energy taken raw by the loss (no linlogcut: a loss event) or inside
    bgflow's BoltzmannGenerator module (a forward event in its ``energy``): the replay names
    the reciprocal of the diagonal's 0 on its line, every row, ``invalid``, and says the 0s
    are each particle's distance to itself, to leave out before the division rather than
    pad with an eps (the generic advice for 1/0)."""
    ev, bundle = fire(kind, make, tmp_path, variant)
    phase, module = ("loss", "<loss>") if kind == "kl" else ("forward", "energy")
    assert (ev["step"], ev["phase"], ev["module"]) == (0, phase, module), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["all_samples"]) == (
        phase, module, "aten.reciprocal", "+inf", True), o
    assert o["source"] == line_of("return 4 * self.eps * ((self.sigma / r) ** 12"), o
    assert [c["op"] for c in o["chain"]] == ["aten.reciprocal", "aten.sub"], o["chain"]
    assert rep["cause"] == "invalid", rep["cause"]
    assert "each point paired with itself" in rep["hint"], rep["hint"]
    assert "torch.triu_indices(n, n, 1)" in rep["hint"], rep["hint"]


def test_hand_written_distance_sqrt_of_the_diagonal_names_sqrt_backward(tmp_path):
    """Pair distances written as ``sqrt(sum(diff ** 2))`` over the whole matrix, the upper
    triangle picked afterwards: the forward is finite, but SqrtBackward0 divides the
    diagonal's 0 incoming gradient by ``2 sqrt(0)`` (NaN) in every configuration. The replay
    names the node, the sqrt's line, every row, and the norm that has a gradient at 0."""
    ev, bundle = fire("kl", "make_flow", tmp_path, "sqrt_triu")
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["all_samples"]) == ("<loss>", "SqrtBackward0", True), o
    assert o["source"] == line_of("r = (diff ** 2).sum(-1).sqrt()"), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "torch.linalg.vector_norm(d, dim=-1)" in rep["hint"], rep["hint"]


def test_unwrapped_md_frame_overflows_the_unbounded_coupling_scale(tmp_path):
    """Maximum likelihood on MD frames, one written in the trajectory's raw unwrapped
    coordinates (4000 nm): the conditioner's unbounded log-scale for it is in the hundreds,
    and the inverse coupling's ``exp(-s)`` overflows. The recorder stops at that coupling's
    call, the replay names the exp, its line, the frame, overflow with the out-of-scale data
    and the tanh-bounded scale in the hint; dropping the frame makes the step finite."""
    ev, bundle = fire("ml", "make_flow", tmp_path, bad=5)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["kind"]) == (
        3, "forward", "layers.1", [5], "+inf"), ev
    rep = nanreplay_json(bundle, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"]) == ("layers.1", 0, "aten.exp", [5]), o
    assert o["source"] == line_of("y = x * m + (1 - m) * (x - t) * torch.exp(-s)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "out of scale" in rep["hint"] and "drop=5" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def test_md_frame_with_a_duplicated_particle_names_the_frame_not_the_diagonal(tmp_path):
    """MD frames simulated warmer, reweighted to the target temperature by a softmax of their
    energies (in log space, as it should be); one frame holds particle 0's record twice, so
    a pair distance off the diagonal is exactly 0, ``sigma / r`` is +inf, ``inf - inf`` NaN,
    and the softmax spreads it to every weight: a loss event. The replay names the
    reciprocal, its line, that frame alone, a degenerate record of the data to repair or
    drop (not the self-pairs' diagonal: this 0 is a pair of two particles); dropping the
    frame makes the step finite."""
    ev, bundle = fire("reweighted_ml", "make_flow_tanh", tmp_path, bad=9)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle, "--try", "drop=9")
    o = rep["origin"]
    assert (o["phase"], o["op"], o["made"], o["samples"]) == (
        "loss", "aten.reciprocal", "+inf", [9]), o
    assert o["source"] == line_of("return 4 * self.eps * ((self.sigma / r) ** 12"), o
    assert rep["cause"] == "invalid" and "repair such records" in rep["hint"], rep["hint"]
    assert "paired with itself" not in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]


def overflowing_log_weights() -> list[int]:
    """The rows whose log-weight exceeds float32's largest exponent in the last step of an
    unrecorded reweighted run (the replay's claim, checked independently)."""
    model = train("reweighted", "make_flow", None, steps=3, record=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        z = M.latent_batch(g)
    with torch.no_grad():
        x, logdet = model(z)
        logq = M.normal_log_prob(z) - logdet
        logw = -BETAS[3] * M.DoubleWell()(x) - logq
    return torch.nonzero(logw > math.log(torch.finfo(torch.float32).max)).flatten().tolist()


def test_importance_weights_exponentiated_before_normalising_overflow_when_cooled(tmp_path):
    """Self-normalised importance weights ``exp(logw) / sum`` at an annealed inverse
    temperature: cooled to beta = 30, a sample deep in the double well's left well has a
    log-weight past 88 and ``exp`` overflows, ``inf / inf`` is NaN. A loss event at the last
    step; the replay names the exp, its line, the overflowing rows (the same an unrecorded
    run computes), overflow, and subtracting the max (normalising in log space)."""
    rows = overflowing_log_weights()
    assert rows, rows
    ev, bundle = fire("reweighted", "make_flow", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (3, "loss", "<loss>"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"]) == (
        "loss", "<loss>", "aten.exp", "+inf", rows), o
    assert o["source"] == line_of("w = torch.exp(logw)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "subtract the row max before exp" in rep["hint"], rep["hint"]


def first_latent_in_a_tail() -> tuple[int, list[int]]:
    """The first spline coupling given a value outside the spline's interval in the first
    step, and those rows (counted by hooks on an unrecorded model)."""
    model = M.make_spline_flow()
    seen: list[tuple[int, torch.Tensor]] = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, (a[0][:, ~m.mask].abs() >= 3).any(1))))
    model(M.latent_batch(torch.Generator().manual_seed(0)))
    i, rows = next((i, rows) for i, rows in seen if rows.any())
    return i, torch.nonzero(rows).flatten().tolist()


def test_spline_root_on_the_tails_names_the_sqrt_the_where_dropped(tmp_path):
    """A neural spline flow sampled by the root of its quadratic, the identity tails chosen
    by ``torch.where(inside, spline, y)`` after running the spline on every value: a latent
    beyond 3 (one in 370 per coordinate of a standard normal) has a negative discriminant,
    ``sqrt`` makes NaN, the where drops it, and its backward multiplies it by 0. A backward
    event at step 0; the replay names the node in the first coupling given a tail value, the
    sqrt that made the NaN on its line, that sample, and the safe input before the op."""
    layer, rows = first_latent_in_a_tail()
    ev, bundle = fire("spline", "make_spline_flow", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (0, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == (f"layers.{layer}", "MulBackward0", rows), o
    assert o["source"] == line_of("return torch.where(inside, theta * wk + xk, y_tails)"), o
    assert (o["chain"][0]["op"], o["chain"][0]["made"]) == ("aten.sqrt", "nan"), o["chain"]
    assert o["chain"][0]["source"] == line_of("theta = 2 * c / (-b - torch.sqrt("), o
    assert rep["cause"] == "invalid" and "sqrt of a negative" in rep["hint"], rep["hint"]
    assert "make the op's input safe before the op" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("kind,make,variant", [
    ("kl", "make_flow", "cdist_triu"), ("ml", "make_flow_tanh", ""),
    ("spline", "make_spline_flow_safe", ""), ("reweighted_ml", "make_flow_tanh", ""),
    ("reweighted", "make_flow", "log_space")])
def test_healthy_runs_raise_nothing_and_train_the_same(tmp_path, kind, make, variant):
    """The pair energy over cdist's upper triangle with linlogcut (whose log branch is NaN
    for every energy below the cutoff, never picked: a NaN that stays inside the where), the
    tanh-bounded coupling on the same frames with the unwrapped one, the spline flow whose
    tails are replaced before the spline (NaN nowhere), and the importance
    weights normalised by a softmax of the log-weights at beta = 30, MD frames reweighted by
    a softmax of their energies: no event, and
    bit-identical weights with and without the recorder."""
    bad = 5 if kind == "ml" else None  # (the reweighted frames: no duplicated particle)
    recorded = train(kind, make, tmp_path, variant, bad)
    plain = train(kind, make, tmp_path, variant, bad, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all(), name


def train_phi4(out_dir, lr: float, steps: int) -> None:
    """Flow-based sampling of the lattice phi^4 field by reverse KL with plain Adam, the
    RealNVP's log-scale unbounded."""
    model = M.make_phi4_flow()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    crit = M.Phi4Action()
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="boltzmann_generators_models:make_phi4_flow") as rec:
        for _ in range(steps):
            x, logdet = model(torch.randn(32, 16, generator=g))
            loss = rec.loss_fn(x, logdet)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_phi4_flow_trained_too_fast_overflows_its_unbounded_scale(tmp_path):
    """Reverse KL on the phi^4 lattice at a learning rate of 0.05: the loss falls for 50
    steps, then the couplings' unbounded log-scales run away and ``x * exp(s)`` goes -inf in
    the last coupling at step 52. The replay names the exp on its line (exponents in the
    ten thousands), its sample, overflow, and the gradient norm's jump 30 steps before: a
    diverging run, for a lower learning rate or clipping."""
    with pytest.raises(NonFiniteError) as info:
        train_phi4(tmp_path, 0.05, 80)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        52, "forward", "layers.3", [15]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["made"], o["samples"]) == (
        "layers.3", 0, "aten.exp", "+inf", [15]), o
    assert o["source"] == line_of("y = x * m + (1 - m) * (x * torch.exp(s) + t)"), o
    assert rep["cause"] == "overflow", rep["cause"]
    assert "the run was diverging" in rep["hint"] and "clip the gradients" in rep["hint"], \
        rep["hint"]


def test_unwrapped_frame_in_an_accumulated_dataloader_step_names_its_micro_batch(tmp_path):
    """Maximum likelihood from a DataLoader of MD frames, two batches of 8 accumulated per
    update: the unwrapped frame 13 of the fourth step's frames is sample 5 of micro-batch 1.
    The recorder and the replay name that micro-batch and row, the exp and the out-of-scale
    data; dropping the row makes the step finite."""
    from torch.utils.data import DataLoader, TensorDataset

    model = M.make_flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    frames = torch.cat([M.md_frames(g, None) for _ in range(3)] + [M.md_frames(g, 13)])
    loader = DataLoader(TensorDataset(frames), batch_size=8, shuffle=False)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=M.MaxLikelihood(), out_dir=tmp_path,
            factory="boltzmann_generators_models:make_flow") as rec:
        for i, (x,) in enumerate(loader):
            z, logdet = model(x, inverse=True)
            (rec.loss_fn(z, logdet) / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                opt.step()
                opt.zero_grad()
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["micro_batch"], ev["samples"]) == (
        3, "layers.1", 1, [5]), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "drop=5")
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"]) == (
        "layers.1", "aten.exp", 1, [5]), o
    assert rep["cause"] == "overflow" and "out of scale" in rep["hint"], rep["hint"]
    assert rep["what_if"][0]["finite"] is True, rep["what_if"]
