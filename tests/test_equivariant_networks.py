"""End to end on E(3)-equivariant interatomic networks (``equivariant_networks_models``):
PaiNN's scalar and vector features passed along a radius graph with ``index_add``, its
vector gate reading ``sqrt(sum(V v ** 2))``, forces ``-dE/dpos`` taken in the forward with
``create_graph=True`` and an energy-and-forces loss (AdamW, ReduceLROnPlateau, gradient
clipping), a QM9 energy model over schnetpack 1.x's padded neighbour lists with DimeNet's
Bessel basis, and a dense EGNN under bfloat16 autocast. Each planted bug fires under the recorder and is replayed with the CLI; the
fixed versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import equivariant_networks_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

ION = 2  # the molecule whose counter-ion is beyond every cutoff, at step 3


def _only_clip_note(rep) -> bool:
    """The one note of these steps: the loop's clip_grad_norm_ (at 10) of the NaN total norm
    spread the origin's NaN into every other parameter's gradient (replay.spread_grads)."""
    return len(rep["problems"]) == 1 and "as a clip_grad_norm_ does" in rep["problems"][0]


def line_of(text: str) -> str:
    return source_line("equivariant_networks_models.py", text)


def train_painn(make: str, out_dir, record: bool = True, plant=M.with_counterion, bad=ION):
    """SchNetPack's recipe: AdamW, ReduceLROnPlateau on the loss, clipping at 10."""
    model = getattr(M, make)()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=2)
    crit = M.EnergyForceLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"equivariant_networks_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for z, pos, batch, e, f, n_atoms in M.batches(bad, plant=plant):
            opt.zero_grad()
            loss = loss_fn(model(z, pos, batch, len(e)), e, f, n_atoms)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step(loss.item())
    return model


def train_padded(make: str, out_dir, record: bool = True):
    """QM9's U0 alone (no forces), L1 loss, Adam."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    crit = torch.nn.L1Loss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"equivariant_networks_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for z, pos, nbh, nmask, amask, e in M.batches(None, collate=M.padded_collate):
            opt.zero_grad()
            loss_fn(model(z, pos, nbh, nmask, amask), e).backward()
            opt.step()
    return model


def train_egnn(make: str, out_dir, record: bool = True):
    """QM9's U0 under bfloat16 autocast, L1 loss, Adam."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    crit = torch.nn.L1Loss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"equivariant_networks_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for z, pos, _, _, amask, e in M.batches(None, collate=M.padded_collate):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(z, pos, amask), e)
            loss.backward()
            opt.step()
    return model


def fire(train, make: str, tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train(make, tmp_path)
    return info.value.event, info.value.bundle_path


def test_painn_gate_of_an_isolated_ion_with_eps_0_names_the_sqrt_and_its_molecule(tmp_path):
    """A sodium counter-ion 9 Angstrom from its molecule has no edge, so its vectors stay
    exactly 0 through every layer and the gate's sqrt(sum(V v ** 2) + eps) is sqrt(0) with
    eps set to 0: the loss's backward makes +inf there, in the update block. The replay names
    the sqrt on its line, the ion's molecule, says the eps is 0, and (the forces being taken
    with create_graph=True) that torch.linalg.vector_norm is no fix here. The forces' own
    derivative nodes, which saved that NaN gradient, are not named as further poles."""
    ev, bundle = fire(train_painn, "make_painn_no_eps", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "updates.1", "SqrtBackward0", "+inf", [ION]), o
    assert o["source"] == line_of("vnorm = torch.sqrt(torch.sum(vv ** 2"), o
    assert rep["cause"] == "invalid", rep
    assert "exactly 0" in rep["hint"] and "sqrt(x + eps)" in rep["hint"], rep["hint"]
    assert "differentiates the forward again" in rep["hint"], rep["hint"]
    assert "takes it with a gradient of 0" not in rep["hint"], rep["hint"]
    assert "also" not in o and _only_clip_note(rep), rep["problems"]


def test_painn_gate_through_vector_norm_names_the_norm_line_not_the_forces_line(tmp_path):
    """The same ion with the gate written as torch.linalg.vector_norm, whose gradient at a
    zero vector is 0: the first-order backward is finite, but the forces' autograd.grad made
    that gradient's graph, and the loss's backward differentiates it again, 0/0. The node
    that makes the NaN was made at the autograd.grad line; the replay names the norm's line
    and the update block it ran in, the molecule, and says to take sqrt(x + eps)."""
    ev, bundle = fire(train_painn, "make_painn_vector_norm", tmp_path)
    assert (ev["step"], ev["phase"], ev["kind"]) == (3, "backward", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"]) == (
        "updates.0", "DivBackward0", "nan", [ION]), o
    assert o["source"] == line_of("vnorm = torch.linalg.vector_norm(vv, dim=-2)"), o
    assert rep["cause"] == "invalid", rep
    assert "derivative the forward took of its LinalgVectorNormBackward0" in rep["hint"], rep
    assert "sqrt(x + eps)" in rep["hint"], rep["hint"]
    assert _only_clip_note(rep), rep["problems"]


def test_smooth_cutoff_past_its_edge_names_the_exp_and_the_double_where(tmp_path):
    """A Verlet list with a 1 Angstrom skin keeps a hydrogen 4.012 Angstrom from atom 0 of
    molecule 4, just past the 4 Angstrom cutoff, where the bump exp(-x^2 / (1 - x^2))
    overflows; the torch.where after it keeps the energy finite, but the forces'
    autograd.grad multiplies that +inf by the where's 0 gradient: NaN forces. The replay
    names the exp on its line and the molecule, and says to make the input safe inside the
    where (the double where), not to rescale or widen a value that is never used."""
    with pytest.raises(NonFiniteError) as info:
        train_painn("make_painn_bump", tmp_path, plant=M.with_shell_atom, bad=4)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (3, "forward", "", [4]), ev
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"], o["samples"], rep["cause"]) == (
        "", "aten.exp", "+inf", [4], "overflow"), rep
    assert o["source"] == line_of("torch.where(x < 1, torch.exp(-x ** 2 / (1 - x ** 2)), 0.0)")
    assert "the double where" in rep["hint"] and "ExpBackward0" in rep["hint"], rep["hint"]
    assert "compute it in float64" not in rep["hint"], rep["hint"]


def test_norm_activation_of_an_isolated_ion_names_the_division_in_the_forward(tmp_path):
    """e3nn's NormActivation with normalize=True and no epsilon, v / |v| * sigmoid(|v| + b):
    the ion's vectors are 0, so the forward's division is 0/0 in the first update block. The
    recorder and the replay name that call, the division on its line, the ion's molecule,
    and an eps in the denominator."""
    ev, bundle = fire(train_painn, "make_painn_norm_activation", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (
        3, "forward", "updates.0", [ION]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["call"], o["op"], o["samples"], rep["cause"]) == (
        "updates.0", 0, "aten.div", [ION], "invalid"), rep
    assert o["source"] == line_of("v = v / vn * torch.sigmoid(vn + self.gate_bias)"), o
    assert "0 by 0" in rep["hint"] and "eps" in rep["hint"], rep["hint"]


def test_accumulated_micro_batches_name_the_ion_in_the_second_micro_batch(tmp_path):
    """Gradient accumulation over two batches per update (the loss halved, one clip and one
    AdamW step per pair): the ion's batch is micro-batch 1 of update 1, whose batch vector
    holds other atom counts than micro-batch 0's. The replay named no molecule there (it read
    the backward's rows with micro-batch 0's batch vector); now the ion's."""
    model = M.make_painn_no_eps()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    crit = M.EnergyForceLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="equivariant_networks_models:make_painn_no_eps") as rec:
            for k, (z, pos, batch, e, f, n_atoms) in enumerate(M.batches(ION)):
                (rec.loss_fn(model(z, pos, batch, len(e)), e, f, n_atoms) / 2).backward()
                if k % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
                    opt.step()
                    opt.zero_grad()
    assert (info.value.event["step"], info.value.event["phase"]) == (1, "backward")
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (o["module"], o["op"], o["micro_batch"], o["samples"], rep["cause"]) == (
        "updates.1", "SqrtBackward0", 1, [ION], "invalid"), rep


def _padded_molecules() -> list[int]:
    """Step 0's molecules smaller than its largest: their neighbour lists hold padding."""
    z, *_ = next(M.batches(None, collate=M.padded_collate))
    n = (z > 0).sum(1)
    return torch.nonzero(n < n.max()).flatten().tolist()


def test_bessel_basis_limit_under_a_where_names_the_division_of_padded_pairs(tmp_path):
    """DimeNet's sin(n pi d / c) / d replaced by its limit n pi / c where d = 0 with a
    torch.where after the division: the padded pairs' 0/0 never reaches the energy, but the
    backward still runs the division there and the learned frequencies' gradient is NaN at
    the first step. The replay names the division on its line in ``rbf``, the padded
    molecules, and says the where must act on the divisor before the division."""
    ev, bundle = fire(train_padded, "make_padded", tmp_path)
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "backward", ["rbf.freq"]), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["made"]) == ("rbf", "DivBackward0", "nan"), o
    assert o["samples"] == _padded_molecules() and len(o["samples"]) < 6, o
    assert o["source"] == line_of("rbf = torch.sin(self.freq * x / self.cutoff) / x"), o
    assert rep["cause"] == "invalid", rep
    assert "safe before the op" in rep["hint"] and "torch.where(" in rep["hint"], rep["hint"]


def test_gram_distances_under_bf16_autocast_name_the_sqrt_and_the_cancellation(tmp_path):
    """EGNN's pair distances from the Gram matrix, whose matmul autocast runs in bfloat16:
    |x_i|^2 + |x_i|^2 - 2 x_i . x_i of an atom with itself rounds below 0 and its sqrt is
    NaN in the first forward, in every molecule. The replay names the sqrt on its line, a
    precision cause (float64 has 0 there), the bfloat16 autocast that fed it, and the
    difference's norm as the fix."""
    ev, bundle = fire(train_egnn, "make_egnn", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"]) == (0, "forward", "", "nan"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "", "aten.sqrt", list(range(6)), "precision"), rep
    assert o["source"] == line_of("d = torch.sqrt(d2)"), o
    assert "bfloat16 autocast" in rep["hint"], rep["hint"]
    assert "torch.linalg.vector_norm(x - y, dim=-1)" in rep["hint"], rep["hint"]


def test_neighbour_attention_of_padding_atoms_names_the_fully_masked_softmax(tmp_path):
    """An equivariant transformer's attention over the padded neighbour lists, padding
    masked to -inf: a padding atom has no neighbour at all, so its row's softmax is all
    -inf, NaN in the first block. The replay names the softmax (the -inf fill intentional),
    the padded molecules, and says to keep one key per row or mask with a finite number."""
    ev, bundle = fire(train_padded, "make_padded_attention", tmp_path)
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "forward", "blocks.0"), ev
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "blocks.0", "aten._softmax", _padded_molecules(), "invalid"), rep
    assert o["source"] == line_of("return h + self.out((logits.softmax(-1)"), o
    assert "fully masked row" in rep["hint"] and "large finite negative" in rep["hint"], rep


@pytest.mark.parametrize("train,make", [(train_painn, "make_painn"),
                                        (train_padded, "make_padded_safe"),
                                        (train_egnn, "make_egnn_differences"),
                                        (train_padded, "make_padded_attention_kept")])
def test_fixed_models_raise_nothing_and_train_the_same(tmp_path, train, make):
    """PaiNN with its eps of 1e-8 on the batch with the isolated ion (forces by
    autograd.grad inside the recorded forward), the Bessel basis with the divisor made safe
    before the division, and the dense EGNN under bfloat16 autocast with the differences'
    norm (0 on the diagonal, which the pair mask's product drops), and the neighbour
    attention whose padding atoms keep one slot (its -inf mask stays inside the softmax):
    no event, bit-identical weights with and without the
    recorder."""
    recorded = train(make, tmp_path)
    plain = train(make, tmp_path, record=False)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_double_where_cutoff_past_its_edge_raises_nothing_and_trains_the_same(tmp_path):
    """The bump cutoff with x made 0 past the edge before the exp, on the batch with the
    hydrogen in the skin: no event, bit-identical weights with and without the recorder."""
    run = {"plant": M.with_shell_atom, "bad": 4}
    recorded = train_painn("make_painn_bump_safe", tmp_path, **run)
    plain = train_painn("make_painn_bump_safe", tmp_path, record=False, **run)
    assert not list(tmp_path.glob("*.nan"))
    for (name, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
