"""A loop that accumulates gradients and writes a weight in place between two micro-batches of
a step (a bit flip, a clamp, a checkpoint load). The recorder watches one weight, the first the
optimizer holds, to notice another optimizer stepping; a write into that one was taken for
another optimizer's update: the step closed at the next forward, the recorder's steps ran one
ahead of the loop's, and a NaN written there was "first seen at step 3" when the loop was at
step 2. The same write into any other weight was (and is) named at its step. Another
optimizer's update (tests/test_optimizer_replaced.py) and SAM's perturbation
(tests/test_hand_updates.py) are still told apart."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import replay_models as R
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

P = 2  # the step in which the loop writes NaN into a weight before its last micro-batch
ROW, COL = 1, 2  # the element it writes


def _train(model, opt, acc: int, write, out_dir=None, steps: int = 4):
    """SGD over ``acc`` micro-batches a step; ``write(step, micro)`` runs before each forward.
    Returns each step's loss (as floats of every micro-batch) and the recorder's step after
    each optimizer step (None without a recorder)."""
    crit = nn.CrossEntropyLoss()
    losses, seen = [], []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="replay_models:make_log_net") if out_dir else None
    with rec if rec is not None else nullcontext():
        for step in range(steps):
            opt.zero_grad()
            for micro in range(acc):
                with torch.no_grad():
                    write(model, step, micro)
                x, y = R.batch(10 * step + micro)
                loss = crit(model(x), y) / acc
                loss.backward()
                losses.append(loss.detach().clone())
            opt.step()
            seen.append(None if rec is None else rec.step)
    return losses, seen


def _log_net_sgd():
    torch.manual_seed(0)
    model = R.make_log_net()
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("param", ["lin.weight", "head.weight"])  # the watched one, another
def test_a_nan_written_between_micro_batches_is_a_weights_event_at_its_step(
        out_dir, caplog, param, acc):
    model, opt = _log_net_sgd()
    assert next(iter(model.parameters())) is model.lin.weight  # (the one the recorder watches)

    def write(model, step, micro):
        if step == P and micro == acc - 1:
            model.get_parameter(param)[ROW, COL] = float("nan")

    with caplog.at_level("WARNING", logger="nanreplay"), pytest.raises(NonFiniteError) as info:
        _train(model, opt, acc, write, out_dir=out_dir)
    assert [r.getMessage() for r in caplog.records if r.name == "nanreplay"] == []
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["params"], ev["kind"]) == (P, "weights", [param], "nan")
    assert (ev["first_seen_step"], ev["last_update_step"]) == (P, P - 1), ev
    assert "written outside optimizer.step()" in ev["detail"], ev["detail"]
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["module"], o["rows"]) == \
        (True, "weights", param, param.rpartition(".")[0], [ROW]), rep
    assert rep["event"]["micro_batches"] == acc
    assert any(p.startswith(f"{param} was first seen non-finite at step {P}")
               and "written outside optimizer.step()" in p for p in rep["problems"]), rep


def test_a_clamp_between_micro_batches_trains_unchanged_at_the_loops_steps(out_dir, caplog):
    """A finite write into the watched weight before each step's second micro-batch (from
    step 1: at step 0 no step before tells it from another optimizer's update): the losses
    are bit-identical with and without the recorder, nothing is said, and the recorder's
    step is the loop's after each update."""
    def write(model, step, micro):
        if step and micro == 1:
            model.lin.weight.clamp_(-0.2, 0.2)

    base, _ = _train(*_log_net_sgd(), 2, write)
    with caplog.at_level("WARNING", logger="nanreplay"):
        got, seen = _train(*_log_net_sgd(), 2, write, out_dir=out_dir)
    assert [r.getMessage() for r in caplog.records if r.name == "nanreplay"] == []
    assert seen == [1, 2, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(base, got)) and len(base) == len(got) == 8


def test_a_nan_written_between_micro_batches_of_the_first_step_is_the_loops_write(
        out_dir):
    """Step 0, before the optimizer's first update: the recorder names the weight the step
    made non-finite (``written_in_step``), as a forward writing its own weights (ActNorm)
    leaves it, and the replay re-ran it from the factory's values; no forward writes it, so
    the event's forward was finite and the report said the weights were 'most likely not the
    model's own' (not reproduced). Now the bundle's values, those the forward of micro-batch 1
    ran with, are re-run: the weights and the loop's write between micro-batches."""
    model, opt = _log_net_sgd()
    param, acc = "head.weight", 2  # (not the watched one: at step 0 that one closes the step)

    def write(model, step, micro):
        if step == 0 and micro == acc - 1:
            model.get_parameter(param)[ROW, COL] = float("nan")

    with pytest.raises(NonFiniteError) as info:
        _train(model, opt, acc, write, out_dir=out_dir)
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["module"]) == (0, acc - 1, "head"), ev
    rep = json.loads(invoke_cli(info.value.bundle_path, "--json").stdout)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["module"], o["micro_batch"],
            o.get("rows")) == (True, "weights", param, "head", acc - 1, [ROW]), rep
    assert "the loop wrote it between the step's micro-batches" in rep["hint"], rep["hint"]
    assert not any("model's own code" in p for p in rep["problems"]), rep["problems"]
