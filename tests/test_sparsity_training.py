"""End to end on hand-written sparse training (``sparsity_training_models``): gradual magnitude
pruning with a topk mask buffer recomputed every k steps and the kept weights renormalised to
the dense norm, and L0 regularisation's hard-concrete gates drawing from their own
``torch.Generator`` with an annealed temperature. Each planted bug of the domain fires under
the recorder and is replayed with the CLI; the healthy versions raise no event and train
bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import sparsity_training_models as M
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("sparsity_training_models.py", text)


def train_pruned(make: str, out_dir, steps: int = 5, record: bool = True, bf16: bool = False):
    """SGD with momentum and clipping; the masks recomputed every 2 steps on the cubic
    schedule (which reaches its final sparsity at step 4); the forward under bf16 autocast
    with ``bf16``. Returns the model."""
    model = getattr(M, make)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"sparsity_training_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            if step % 2 == 0:
                model.update_masks(step)
            x, y = M.batch(g)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return model


def train_l0(out_dir, beta_end: float, steps: int = 4, record: bool = True,
             make: str = "make_l0"):
    """Adam; the gate's temperature annealed linearly from 2/3 to ``beta_end``."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=M.l0_loss, out_dir=out_dir,
                         factory=f"sparsity_training_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.l0_loss
        for step in range(steps):
            model.gate.beta = 2 / 3 + (beta_end - 2 / 3) * step / (steps - 1)
            x, y = M.batch(g)
            loss = loss_fn(*model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_layer_pruned_to_full_sparsity_names_the_empty_mask(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_pruned("make_pruned_full", tmp_path)
    assert info.value.event["step"] == 4
    report = nanreplay_json(info.value.bundle_path)
    o = report["origin"]
    assert (report["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "forward", "fc1", "aten.div")
    assert o["source"] == line_of("w = w * (self.weight.norm() / w.norm())")
    assert o["samples"] == list(range(8))  # (no sample to blame: the layer's own mask)
    assert report["cause"] == "invalid"
    hint = report["hint"]
    # the mask that keeps nothing, not a power iteration's state vector
    assert "buffer fc1.mask" in hint and "100 % sparsity" in hint
    assert "k = max(1, ...)" in hint and "power iteration" not in hint


def test_gate_temperature_annealed_to_zero_names_the_division(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_l0(tmp_path, beta_end=0.0)
    assert info.value.event["step"] == 3
    report = nanreplay_json(info.value.bundle_path)
    o = report["origin"]
    assert (report["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "backward", "gate", "DivBackward0")
    assert o["source"] == line_of("s = torch.sigmoid((u.log()")
    assert o["param"] == "gate.log_alpha"
    assert report["cause"] == "invalid" and "temperature" in report["hint"]
    assert any("gate.beta = 0.0" in n for n in report["problems"])


def test_global_threshold_emptying_a_neuron_names_its_mask_rows(tmp_path):
    """A global kthvalue threshold over all layers prunes every weight of some of fc2's
    neurons; their per-row renormalisation is 0 * inf. The rows named are checked against an
    unrecorded copy of the run's masks at that step."""
    with pytest.raises(NonFiniteError) as info:
        train_pruned("make_global", tmp_path)
    assert info.value.event["step"] == 2
    report = nanreplay_json(info.value.bundle_path)
    o = report["origin"]
    assert (report["reproduced"], o["phase"], o["module"], o["op"]) == (
        True, "forward", "fc2", "aten.div")
    assert o["source"] == line_of("scale = self.weight.norm(dim=1, keepdim=True)")
    plain = train_pruned("make_global", None, steps=2, record=False)
    plain.update_masks(2)
    rows = (plain.fc2.mask == 0).all(1).nonzero().flatten().tolist()
    assert rows and (plain.fc1.mask != 0).any(1).all()  # (fc1 keeps a weight in every row)
    assert report["cause"] == "invalid"
    assert f"buffer fc2.mask, a 0/1 mask of fc2.weight's shape, is 0 in whole rows {rows}" \
        in report["hint"] and "per layer or row" in report["hint"]


@pytest.mark.filterwarnings("ignore:invalid value encountered in log")
def test_l0_penalty_with_a_positive_gamma_names_the_numpy_nan(tmp_path):
    """gamma typed as 0.1: the expected-L0 penalty's np.log(-gamma / zeta) is a numpy NaN
    (a warning, no error) that aten.sub takes as a number beside finite tensors; the report
    names that number, not an overflow of log_alpha."""
    with pytest.raises(NonFiniteError) as info:
        train_l0(tmp_path, beta_end=2 / 3, make="make_l0_positive_gamma")
    assert info.value.event["step"] == 0
    report = nanreplay_json(info.value.bundle_path)
    o = report["origin"]
    assert (report["reproduced"], o["phase"], o["module"], o["op"], o["made"]) == (
        True, "forward", "", "aten.sub", "nan")
    assert o["source"] == line_of("return torch.sigmoid(self.log_alpha")
    assert report["cause"] == "invalid"
    hint = report["hint"]
    assert hint.startswith("aten.sub was given NaN as a number") and "np.log" in hint
    assert "gate.log_alpha" not in hint  # (the parameter beside it is not to blame)


@pytest.mark.parametrize("run", ["pruned", "movement_bf16", "l0", "l0_bf16_noise"])
def test_healthy_sparse_training_is_not_stopped_nor_changed(tmp_path, run):
    """Including movement pruning under bf16 autocast, whose scores outside a fixed block
    layout are -inf inside the forward (before the topk), and hard-concrete noise drawn in bf16 and not clamped: some u are exactly 0, so
    log(u) is -inf inside the gate, which closes it (sigmoid(-inf) = 0) with finite outputs
    and gradients: no event."""
    def trained(record: bool):
        if run == "pruned":
            return train_pruned("make_pruned", tmp_path / str(record), record=record)
        if run == "movement_bf16":
            return train_pruned("make_movement", tmp_path / str(record), record=record,
                                bf16=True)
        return train_l0(tmp_path / str(record), beta_end=0.1, record=record,
                        make=f"make_{run}")

    on, off = trained(True), trained(False)
    assert not list(tmp_path.rglob("*.nan"))
    for (name, a), (_, b) in zip(on.state_dict().items(), off.state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_gate_noise_does_draw_exact_zeros():
    """(The healthy bf16 run above does meet log(0): its gate's generator draws u = 0.)"""
    gate = M.make_l0_bf16_noise().gate
    assert (torch.rand((8, 32), generator=gate.gen, dtype=torch.bfloat16) == 0).any()
