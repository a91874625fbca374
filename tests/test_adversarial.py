"""End to end: adversarial training and certified robustness as the well-known repositories
write it (``adversarial_models``): PGD inner loops that differentiate the loss w.r.t. the
input between the step's forwards, TRADES and MART losses, double backprop. The attack's
forwards are micro-batches of the step; a NaN its step made in the next forward's input is
the loop's, not the data's."""

from __future__ import annotations

from pathlib import Path

import adversarial_models as A
import pytest
import torch
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
N = 16


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # adversarial_models.py is trusted here


def train_pgd_l2(out_dir, steps: int, tiny: float = 0.0):
    model = A.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    crit = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="adversarial_models:make_net"):
        for _ in range(steps):
            x, y = A.images(g, N)
            x_adv = A.pgd_l2(model, x, y, tiny=tiny)
            loss = crit(model(x_adv), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_pgd_l2_zero_input_gradient_is_named_as_the_attacks_step(tmp_path):
    """FAT's early-stopped PGD-L2 masks the attack's loss to the samples still classified
    correctly; the others' input gradient is exactly 0 and ``g / ‖g‖`` is 0/0, so the attack's
    second forward takes NaN rows. The report blamed the data ("the batch itself holds
    NaN/Inf"; with every row NaN, "a division by a scalar that is 0") although the batch was
    made by the loop from the first forward's input, which the bundle holds finite."""
    x, y = A.images(torch.Generator().manual_seed(0), N)
    with torch.no_grad():
        wrong = (A.make_net().eval()(x).argmax(1) != y).nonzero().flatten().tolist()
    assert 0 < len(wrong) < N
    with pytest.raises(NonFiniteError) as info:
        train_pgd_l2(tmp_path, 3)
    err = info.value
    ev = err.event
    assert (ev["step"], ev["phase"], ev["micro_batch"], ev["samples"]) == (0, "input", 1, wrong)
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["phase"], o["tensor"], o["micro_batch"],
            o["samples"], o["made"]) == (True, "input", "input", "batch", 1, wrong, "nan"), rep
    hint = rep["hint"]
    assert "the loop made it between the step's forwards from the input of micro-batch 0" \
        in hint, hint
    assert "clamp_min(1e-12)" in hint and "batch itself holds" not in hint, hint
    text = invoke_cli(err.bundle_path).stdout
    assert "gradient of exactly 0 into the model's output in micro-batch 0" in text, text


def test_pgd_l2_with_the_norm_guarded_raises_nothing(tmp_path):
    train_pgd_l2(tmp_path, 3, tiny=1e-12)
    assert not list(tmp_path.glob("*.nan"))
