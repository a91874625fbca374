"""A loop with two optimizers, the recorder given one: a fine-tune whose head has its own
optimizer, at a rate mistyped 1e30. The head's update grows its weights until its addmm
overflows. The replay named that op and module, but its hint said to lower the learning rate
(``--try lr=0.1x``), which scales the recorded optimizer, not the one that grew the head; the
try ran as if it tested a fix. The hint now says the head's weights were updated by an
optimizer the recorder was not given (their norm before and after), and the try says it
cannot test it."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import replay_models as R
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")

HEAD_LR = 1e30  # the plant: the head optimizer's rate (meant 1e-3)
STEPS = 5


def _train(head_lr: float, out_dir=None):
    """make_mlp's body (0) on the recorded SGD, its head (2) on an SGD of its own, stepped
    after the recorded one (as the guide asks). Returns the losses and, per step, the rows
    whose head output was non-finite."""
    torch.manual_seed(0)
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05)
    head_opt = torch.optim.SGD(model[2].parameters(), lr=head_lr)
    bad: list[list[int]] = []
    model[2].register_forward_hook(lambda m, i, out: bad.append(
        (~torch.isfinite(out)).any(1).nonzero().flatten().tolist()))
    losses = []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) if out_dir else None
    with rec if rec is not None else nullcontext():
        for step in range(STEPS):
            opt.zero_grad()
            head_opt.zero_grad()
            x, y = R.batch(step)
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            head_opt.step()
            losses.append(loss.detach().clone())
    return losses, bad, model


def test_head_grown_by_an_unrecorded_optimizer_is_named_in_the_hint(out_dir):
    _, bad, _ = _train(HEAD_LR)  # (the plant's run without the recorder: where it overflows)
    at = next(i for i, rows in enumerate(bad) if rows)
    torch.manual_seed(0)
    first_norm = float(R.make_mlp()[2].weight.detach().norm())  # (the head as built, before its update)
    with pytest.raises(NonFiniteError) as info:
        _train(HEAD_LR, out_dir)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (at, "forward"), ev
    meta, _ = read_bundle(info.value.bundle_path)
    assert meta["unheld_trained"] == ["2.weight", "2.bias"]  # (the head's: head_opt's)
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json", "--try", "lr=0.1x").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"], o["module"], o["samples"]) == \
        (True, "overflow", "aten.addmm", "2", bad[at]), rep
    assert ("the weights of 2 (2.weight, 2.bias) were updated by an optimizer the recorder was "
            "not given (the recorded SGD holds 0.weight, 0.bias only): their norm went from "
            f"{first_norm:.4g} at step 0 to ") in rep["hint"], rep["hint"]
    assert "lowering the recorded one's (--try lr=0.1x) changes nothing of theirs" in rep["hint"]
    (tried,) = rep["what_if"]
    assert (tried["try"], tried["finite"]) == ("lr=0.1x", None), tried
    assert "updated by an optimizer the recorder was not given" in tried["note"], tried


def test_head_in_the_recorded_optimizer_keeps_the_rate_advice(out_dir):
    """The same rate as the recorded optimizer's second group: its rate is the one to lower."""
    torch.manual_seed(0)
    model, crit = R.make_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[2].parameters(), "lr": HEAD_LR}], lr=0.05)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(model, opt, loss_fn=crit,
                                                                out_dir=out_dir):
        for step in range(STEPS):
            opt.zero_grad()
            x, y = R.batch(step)
            crit(model(x), y).backward()
            opt.step()
    assert "unheld_trained" not in read_bundle(info.value.bundle_path)[0]
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    assert rep["origin"]["module"] == "2", rep
    assert "not given" not in rep["hint"] and "learning rate" in rep["hint"], rep["hint"]


def test_healthy_head_rate_trains_bit_identically(out_dir):
    plain, bad, _ = _train(1e-3)
    recorded, _, _ = _train(1e-3, out_dir)
    assert not any(bad)
    assert torch.equal(torch.stack(plain), torch.stack(recorded))
    assert not out_dir.exists() or not list(out_dir.iterdir())
