"""End to end: gradients from ``torch.autograd.grad`` and an update by hand, recorded with no
optimizer. ``autograd.grad`` writes no ``.grad``, so the recorder sees its gradients as they
pass (a tensor hook on each parameter) and closes the step as it returns: a backward-only
trap is named at its own step, its backward node and samples, before the hand update spreads
it into the weights."""

from __future__ import annotations

import logging

import grad_only_models as M
import pytest
import torch
from bundles import nanreplay_json
from test_recorder_sync import FLIGHT, count_host_reads
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

STEPS, LR, K, ROW = 4, 0.05, 2, 5


def train(model, style: str, zero_at=None, reads: list | None = None,
          weightless: int | None = None) -> list[float]:
    """The loop (``style``: "sgd", "maml", "penalty"); ``reads``: the recorder's host reads
    per iteration; ``zero_at``: (step, row) of a record of zeros (in MAML's query set);
    ``weightless``: a step whose records all weigh 0 (a batch of padding, "penalty")."""
    crit, losses = nn.MSELoss(), []
    data, queries = M.batches(STEPS), M.batches(STEPS, zero_at, seed=1)
    if style != "maml":
        data = M.batches(STEPS, zero_at)
    with count_host_reads() as calls:
        for step in range(STEPS):
            seen, (x, y) = len(calls), data[step]
            if style == "sgd":
                loss = crit(model(x), y)
                M.sgd_step(model, loss, LR)
            elif style == "maml":
                loss = M.maml_step(model, (x, y), queries[step], LR)
            else:
                weights = torch.full((M.N, 1), float(step != weightless))
                loss = M.penalty_step(model, x, y, weights, LR)
            losses.append(loss.item())
            if reads is not None:
                reads.append([c for c in calls[seen:] if c[1] == FLIGHT])
    return losses


def recorded(make: str, style: str, out_dir, **kw) -> NonFiniteError:
    torch.manual_seed(0)
    model = getattr(M, make)()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, loss_fn=nn.MSELoss(), out_dir=out_dir,
                            factory=f"grad_only_models:{make}"):
            train(model, style, **kw)
    return info.value


# forwards per iteration: with no optimizer, each root forward is a step of the recorder
@pytest.mark.parametrize("style, forwards", [("sgd", 1), ("maml", 2), ("penalty", 1)])
def test_autograd_grad_updates_train_bit_identically_with_one_read_a_step(out_dir, style,
                                                                         forwards, caplog):
    """The tensor hooks change nothing the loop computes: the same losses to the bit, no
    event nor warning, and one host read per step."""
    torch.manual_seed(0)
    plain = train(M.make_net(), style)
    torch.manual_seed(0)
    model, reads = M.make_net(), []
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with FlightRecorder(model, loss_fn=nn.MSELoss(), out_dir=out_dir,
                            factory="grad_only_models:make_net") as rec:
            got = train(model, style, reads=reads)
            assert rec.cycle.step == forwards * STEPS
    assert got == plain
    assert [len(r) for r in reads] == [forwards] * STEPS
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert not list(out_dir.glob("*.nan"))


def test_a_log_trap_under_autograd_grad_is_named_at_its_step(out_dir):
    """A record of zeros at step K under where(x > 0, log(x), 0): its gradient is 0 / 0 in
    LogBackward0 on that record only. The step closes as autograd.grad returns: a backward
    event at step K, before the hand update, and the replay names the node, module, sample."""
    err = recorded("make_net", "sgd", out_dir, zero_at=(K, ROW))
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid"
    origin = rep["origin"]
    assert (origin["op"], origin["module"], origin["samples"]) == ("LogBackward0", "safelog",
                                                                    [ROW])


def test_a_sqrt_at_each_rows_minimum_is_named_at_the_first_step(out_dir):
    """sqrt(h - h.min(dim=1)): every row's minimum is sqrt(0), whose gradient is +Inf, from the
    first step on: step 0's backward, SqrtBackward0 in the module, every row."""
    err = recorded("make_spread_net", "sgd", out_dir)
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid"
    origin = rep["origin"]
    assert (origin["op"], origin["module"], origin["samples"]) == (
        "SqrtBackward0", "act", list(range(M.N)))


def test_a_trap_in_mamls_query_set_is_named_at_its_step(out_dir):
    """Second-order MAML by hand: two forwards per iteration (support, query), each a step. The
    meta-gradient's autograd.grad closes the query's step, so the log trap planted in
    iteration K's query set is a backward event of that step (not the next one's weights)."""
    err = recorded("make_net", "maml", out_dir, zero_at=(K, ROW))
    assert (err.event["step"], err.event["phase"]) == (2 * K + 1, "backward")


def test_a_gradient_penalty_is_checked_with_the_steps_gradient(out_dir):
    """A gradient-norm penalty: autograd.grad with create_graph=True inside the step is the
    loop's own term and closes nothing; the update's autograd.grad closes the step. At step K
    every record weighs 0: the gradient is 0, its norm sqrt(0), whose backward sends Inf * 0
    into the update's gradients only: a backward event at step K (closed at the inner
    gradient, the step would miss them and the NaN would reach the weights unseen)."""
    err = recorded("make_net", "penalty", out_dir, weightless=K)
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
