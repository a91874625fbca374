"""Norm layers' running statistics: "training is fine, validation is wrong".

One outlier batch (a record of 1e20) makes a BatchNorm's batch variance overflow float32, and the
layer writes +inf into ``running_var``. Training mode reads each batch's own statistics, so the
output, the loss and the gradients stay finite; the recorder checks the statistics as each
training step closes (``recorder.running_stats``): the event is that step's, and the replay
names the op and the outlier's row. A statistic already non-finite as a step began (the
recorder attached later) is said so (``replay.overflowed_statistics``). Healthy runs with
evaluation forwards between steps are unchanged by the recorder, running statistics included.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH = 16


class RateNet(nn.Module):
    """Per-unit rates (features over the record's count, column 0) through a BatchNorm MLP."""

    def __init__(self, momentum: float | None = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(3, 8)
        self.bn = nn.BatchNorm1d(8, momentum=momentum)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        rates = x[:, 1:] / x[:, :1]
        return self.fc2(torch.relu(self.bn(self.fc1(rates))))


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.rand(BATCH, 1, generator=g) * 5 + 1
    return (torch.cat([counts, torch.randn(BATCH, 3, generator=g)], 1),
            torch.randint(0, 3, (BATCH,), generator=g))


def _train(out_dir, momentum, outlier: tuple[int, int] | None, zero: tuple[int, int],
           dtype: torch.dtype = torch.float32):
    """Train until the record ``zero`` (step, row) of count 0 raises; ``outlier`` (step, row)
    holds features of 1e20; model and batches in ``dtype``. Returns (the error,
    bn.running_var as that step began)."""
    torch.manual_seed(0)
    model = RateNet(momentum).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(zero[0] + 1):
                x, y = _batch(g)
                x = x.to(dtype)
                if outlier is not None and step == outlier[0]:
                    x[outlier[1], 1:] = 1e20
                if step == zero[0]:
                    x[zero[1], 0] = 0
                began = model.bn.running_var.clone()
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value, began


@pytest.mark.parametrize("momentum", [0.1, None])
def test_an_outlier_that_overflows_running_var_is_that_steps_event(tmp_path, momentum):
    """The statistic is state the step wrote: the event is the outlier's step, at the layer,
    though its output, the loss and the gradients are finite; the replay names the batch
    norm's op, the outlier's row, an overflow, and what the statistic does to evaluation."""
    outlier = (2, 5)
    err, began = _train(tmp_path, momentum, outlier, (outlier[0] + 3, 9))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["statistic"], ev["kind"]) == \
        (outlier[0], "forward", "bn", "bn.running_var", "+inf")
    assert bool(torch.isfinite(began).all())  # (finite as the step began: the step wrote it)
    assert "Running statistic bn.running_var holds +inf after the step's forward" in str(err)
    r = replay.replay(err.bundle_path, factory=lambda: RateNet(momentum), tries=["drop=5"])
    o = r["origin"]
    assert r["reproduced"] is True and r["bisection"]["agrees"] is True
    assert (o["phase"], o["module"], o["op"], o["made"], o["samples"], r["cause"]) == \
        ("forward", "bn", "aten.native_batch_norm", "+inf", [outlier[1]], "overflow")
    assert [p for p in r["problems"] if p.startswith("bn.running_var is what went non-finite")]
    assert r["what_if"][0]["finite"] is True  # (without the outlier's row)


def test_a_bfloat16_models_statistic_is_checked_too(tmp_path):
    """A model trained in bfloat16 throughout (``model.to(torch.bfloat16)``) keeps its running
    statistics in bfloat16: the check read float32 ones only, so the outlier's +inf went
    unseen and the run stopped three steps later at the zero count, in ``rates``. It is the
    outlier's step now, and the replay names the batch norm's op and the outlier's row."""
    outlier = (2, 5)
    err, _ = _train(tmp_path, 0.1, outlier, (5, 9), torch.bfloat16)
    ev = err.event
    assert (ev["step"], ev["module"], ev["statistic"], ev["kind"]) == \
        (outlier[0], "bn", "bn.running_var", "+inf")
    r = replay.replay(err.bundle_path, factory=lambda: RateNet().to(torch.bfloat16))
    o = r["origin"]
    assert (r["reproduced"], o["module"], o["op"], o["samples"], r["cause"]) == \
        (True, "bn", "aten.native_batch_norm", [outlier[1]], "overflow")


def test_a_statistic_already_overflowed_before_the_attach_is_said_so(tmp_path):
    """Trained without the recorder through the outlier's step, then recorded: the first
    recorded step's check sees the statistic, which it did not write; the replay's note names
    it as non-finite when the step began."""
    torch.manual_seed(0)
    model = RateNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)

    def step(x, y):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()

    for k in range(3):  # (bare: the outlier at step 2)
        x, y = _batch(g)
        if k == 2:
            x[5, 1:] = 1e20
        step(x, y)
    bad = int((~torch.isfinite(model.bn.running_var)).sum())
    assert bad > 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            step(*_batch(g))
    ev = info.value.event
    assert (ev["step"], ev["module"], ev["statistic"], ev["inputs_finite"]) == \
        (0, "bn", "bn.running_var", False)
    assert "already held +inf as the step began" in str(info.value)
    r = replay.replay(info.value.bundle_path, factory=RateNet)
    assert (r["origin"]["module"], r["origin"]["params"], r["cause"]) == \
        ("bn", ["bn.running_var"], "weights")
    assert f"bn.running_var ({bad} of 8 entries) held +Inf as step 0 began" in r["hint"]
    assert "reset_running_stats()" in r["hint"]
    assert not [p for p in r["problems"] if "bn.running_var" in p]  # (said once)


def test_finite_running_statistics_get_no_note(tmp_path):
    err, began = _train(tmp_path, 0.1, None, (3, 4))
    r = replay.replay(err.bundle_path, factory=RateNet)
    assert bool(torch.isfinite(began).all())
    assert r["origin"]["samples"] == [4] and r["cause"] == "invalid"
    assert not [p for p in r["problems"] if "running_" in p]


class ConvBN(nn.Module):
    """BatchNorm2d, GroupNorm and BatchNorm1d in one small classifier."""

    def __init__(self, momentum: float | None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum)
        self.gn = nn.GroupNorm(2, 4)
        self.bn1 = nn.BatchNorm1d(4, momentum=momentum)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.gn(torch.relu(self.bn2(self.conv(x)))).mean((2, 3))
        return self.head(self.bn1(h))


def _healthy(out_dir, record: bool, momentum, forget_eval: bool):
    torch.manual_seed(0)
    model = ConvBN(momentum)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(3)
    losses = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) if record \
            else contextlib.nullcontext():
        for _ in range(4):
            model.train()
            x, y = torch.randn(8, 2, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if not forget_eval:
                model.eval()
            with torch.no_grad():  # (validation; in train mode it updates the statistics)
                xv = torch.randn(4, 2, 5, 5, generator=g)
                losses.append(crit(model(xv), torch.randint(0, 3, (4,), generator=g)).item())
    return losses, model.state_dict()


@pytest.mark.parametrize(("momentum", "forget_eval"), [(0.1, False), (None, True)])
def test_healthy_running_statistics_unchanged(tmp_path, momentum, forget_eval):
    plain, plain_state = _healthy(tmp_path / "plain", False, momentum, forget_eval)
    seen, seen_state = _healthy(tmp_path / "rec", True, momentum, forget_eval)
    assert seen == plain
    assert plain_state.keys() == seen_state.keys()
    assert all(torch.equal(plain_state[k], seen_state[k]) for k in plain_state)
    assert not list(tmp_path.glob("rec/*.nan"))
