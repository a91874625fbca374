"""End to end: ``torch.cond`` and ``torch.while_loop`` in a training forward
(``control_flow_models``), also under activation checkpointing and ``torch.compile``, recorded
in a real loop, then replayed. Under the replay's watching modes dynamo no longer traced the
operators, which then got the user's callables as written: the forward's op was not named and
the float64 re-run raised ('Tracing expected 2 arguments', a bound method as the branch), and
cond's backward raised inside torch ('object of type bool has no len()'), so neither finder
named the op inside the branch or the loop body."""

from __future__ import annotations

import control_flow_models as M
import pytest
import torch
from bundles import source_line

from recorder import FlightRecorder, NonFiniteError
from replay import replay

# (dynamo's tracing of a cond reads a non-leaf's .grad; a compiled model's, outside the
# models' own filter of it)
pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:The .grad attribute:UserWarning")]
ROW = 2
MODELS = "control_flow_models.py"


def train(out_dir, factory: str, plant=None, record: bool = True):
    """Losses of 2 SGD steps, and the NonFiniteError (None when clean); ``plant(x)`` writes
    the bad record into step 1's batch."""
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses, loss_fn = [], torch.nn.functional.mse_loss
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"control_flow_models:{factory}") if record else None
    try:
        with rec or torch.enable_grad():
            for step in range(2):
                x, y = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
                if plant is not None and step == 1:
                    plant(x)
                opt.zero_grad()
                loss = (rec.loss_fn if rec else loss_fn)(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return losses, e
    return losses, None


def _far_negative(x):
    x[ROW].mul_(-1e3)  # a corrupt record: its activations far outside the log's domain


def _zero(x):
    x[ROW].zero_()  # a blank record: its activations 0 (bias-free input layer)


@pytest.mark.parametrize("factory, plant, op, line", [
    ("make_cond_log_ckpt", _far_negative, "aten.log", "no clamp: branch log"),
    # the submodule itself as the branch: the recorder's hooks ran inside the cond's trace,
    # where writing the recorder's state was a side effect dynamo refused, failing training
    ("make_cond_log_modules", _far_negative, "aten.log", "no clamp: branch log"),
    ("make_newton", _zero, "aten.div", "no eps: loop body")])
def test_forward_nan_inside_a_branch_or_loop_body_names_the_op_its_line_and_sample(
        tmp_path, factory, plant, op, line):
    _, err = train(tmp_path, factory, plant)
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (
        1, "forward", "mid"), err.event
    rep = replay(err.bundle_path, factory=getattr(M, factory))
    o = rep["origin"]
    assert rep["reproduced"] is True and rep.get("failed_stage") is None, rep
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == ("mid", op, [ROW], "invalid"), rep
    assert o["source"] == source_line(MODELS, line), rep


@pytest.mark.parametrize("factory, plant, step, rows, line", [
    # every row has a minimum: sqrt at 0 in each, at the first step
    ("make_cond_root", None, 0, list(range(6)), "0 at the row minimum"),
    # only the blank record's z * z + h is 0
    ("make_root_refine", _zero, 1, [ROW], "no eps: loop root")])
def test_backward_only_nan_inside_a_branch_or_loop_body_names_the_sqrt_node(
        tmp_path, factory, plant, step, rows, line):
    _, err = train(tmp_path, factory, plant)
    assert (err.event["step"], err.event["phase"]) == (step, "backward"), err.event
    rep = replay(err.bundle_path, factory=getattr(M, factory))
    o = rep["origin"]
    assert rep["reproduced"] is True and rep.get("failed_stage") is None, rep
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        "backward", "mid", "SqrtBackward0", rows, "invalid"), rep
    assert o["source"] == source_line(MODELS, line), rep
    # (the hop's own node is the same sqrt, not another place to fix)
    assert not o.get("also") and not rep["problems"], rep


# (a compiled model: the recorder's hooks outside its graph, the cond traced inside it; a
# submodule as the branch or called in the loop body: its hooks traced inside the operator,
# where a write to the recorder's state made dynamo refuse the step: training failed)
@pytest.mark.parametrize("factory", ["make_cond_log_ckpt", "make_root_refine",
                                     "make_compiled_cond_log", "make_cond_log_modules",
                                     "make_linear_refine"])
def test_healthy_runs_are_bit_identical_and_silent(tmp_path, factory):
    recorded, err = train(tmp_path, factory)
    assert err is None and not list(tmp_path.iterdir())
    assert recorded == train(tmp_path, factory, record=False)[0]
