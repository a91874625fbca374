"""Backward origins name their samples (issue 11, item 3).

A NaN made only in backward (sqrt at 0, the ``torch.where(x > 0, log(x), 0)`` gradient trap,
the distance of two equal embeddings) names the autograd node, its module and, as forward
events do, the batch rows (dim 0 of the batch's size) of the first non-finite gradient that
node returned. Each test trains as a user would, runs ``nanreplay BUNDLE --json`` and asserts
phase, step, module, node, samples and cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import cause_models as C
import pytest
import replay_models as R
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K = 3


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(module, factory: str, batches, out_dir: Path, steps: int = 6) -> NonFiniteError:
    """Train ``module.<factory>()`` (SGD with momentum, cross entropy) on ``batches(step)``, a
    list of micro-batches ``(args, target)`` whose losses are averaged (accumulation)."""
    model = getattr(module, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"{module.__name__}:{factory}"):
            for step in range(steps):
                mbs = batches(step)
                opt.zero_grad()
                for args, y in mbs:
                    (crit(model(*args), y) / len(mbs)).backward()
                opt.step()
    assert info.value.event["phase"] == "backward", info.value.event
    return info.value


def check(rep: dict, **expected) -> None:
    o = rep["origin"]
    got = {k: (rep[k] if k in ("cause", "reproduced") else
               rep["event"]["step"] if k == "step" else o.get(k)) for k in expected}
    assert got == expected, json.dumps({k: v for k, v in rep.items()}, indent=1)


def zero_rows(rows, n: int = R.BATCH, step: int = K):
    """One micro-batch of ``replay_models.batch``; at ``step`` the given rows are all zero."""

    def batches(s):
        x, y = R.batch(s, n=n)
        if s == step:
            x[list(rows)] = 0.0
        return [((x,), y)]

    return batches


def test_a_custom_function_applied_by_the_parent_is_the_parents(tmp_path):
    """A custom ``autograd.Function`` whose backward divides by 0, applied by the root's own
    code between two layers: its node is the root's (the next layer's walk back through the
    graph stops at the nodes older than its input), with the zero row as the sample."""
    err = train(C, "make_custom_function_net", zero_rows([5]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="", op="_SqrtBackward", samples=[5],
          cause="invalid", reproduced=True)
    line = next(i for i, text in enumerate((HERE / "cause_models.py").read_text().splitlines(), 1)
                if "_Sqrt.apply(self.lin(x)" in text)
    assert rep["origin"]["source"] == f"cause_models.py:{line}", rep["origin"]


def test_a_custom_functions_backward_names_the_op_and_line_of_its_own_code(tmp_path):
    """The same hand-written backward: the node is made at the forward line, but the bug is in
    the backward's formula (``grad / (2 * y)`` at y = 0). The report names that op and line
    in a note (it named only the forward line, and its hint spoke of guarding the forward)."""
    err = train(C, "make_custom_function_net", zero_rows([5]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="", op="_SqrtBackward", samples=[5],
          cause="invalid", reproduced=True)
    line = next(i for i, text in enumerate((HERE / "cause_models.py").read_text().splitlines(), 1)
                if "return grad / (2 * y)" in text)
    made = rep["origin"]["made"]
    assert any(p.startswith(f"_SqrtBackward is a custom autograd.Function's backward: its own "
                            f"code made the {made}, aten.div at cause_models.py:{line} "
                            "(return grad / (2 * y)") for p in rep["problems"]), rep["problems"]


def test_a_custom_backward_at_a_residual_rounding_made_zero_is_precision_not_overflow(
        tmp_path):
    """A custom loss whose hand-written backward divides by the residual: sample 5's target
    was copied from the float32 prediction, so its residual is exactly 0 and the backward 0/0.
    In float64 the prediction differs from that float32 target, the residual is not 0 and the
    gradient finite. That is rounding putting the input on the formula's pole (precision),
    told by the op the backward made it with (aten.div), not "a gradient too large for its
    dtype" (overflow), which the node's unknown name gave."""
    model = C.make_regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = C.AbsLogLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="cause_models:make_regressor"):
            for step in range(6):
                x, _ = R.batch(step)
                y = x.sum(1)
                out = model(x)
                if step == K:
                    y[5] = out[5].detach()  # a target filled from the prediction (leakage)
                opt.zero_grad()
                crit(out, y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    check(rep, step=K, phase="backward", module="<loss>", op="_AbsLogBackward", samples=[5],
          cause="precision", reproduced=True)
    assert "rounding put the op's input on its pole" in rep["hint"], rep["hint"]


def test_where_gradient_trap_names_its_row(tmp_path):
    """torch.where(h² > 0, log(h²), 0): finite forward; backward sends 0 into log's
    derivative 1/x at x = 0, which is 0/0 (LogBackward0), for the zero row only."""
    err = train(C, "make_where_net", zero_rows([5]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="logf", op="LogBackward0", made="nan",
          samples=[5], micro_batch=0, cause="invalid", reproduced=True)
    assert "torch.where(mask, x, 1)" in rep["hint"], rep["hint"]


def test_sqrt_at_zero_names_its_row_not_the_weight_rows(tmp_path):
    """LengthNet's sqrt of a zero row's squared length. Its weight's gradient also has 8 rows
    (HIDDEN == BATCH), but only the activation's gradient names samples."""
    assert R.HIDDEN == R.BATCH
    err = train(R, "make_length_net", zero_rows([6]), tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="feat", op="SqrtBackward0", made="+inf",
          samples=[6], cause="invalid", reproduced=True)


def test_a_gain_as_wide_as_the_batch_names_no_samples(tmp_path):
    """A loop that prunes feature 2 by zeroing its gain, ``sqrt(|g|)``'s pole at 0: sqrt's
    gradient there is no sample's, it is the gain's. It named samples [2] (the gain's entry,
    read as a row of a batch of as many rows)."""
    assert C.HIDDEN == R.BATCH
    model = C.make_gain_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="cause_models:make_gain_net"):
            for step in range(6):
                if step == K:
                    with torch.no_grad():
                        model.gain[2] = 0.0
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    check(rep, step=K, phase="backward", module="", op="SqrtBackward0", samples=[], param="gain", cause="invalid", reproduced=True)


def test_distance_of_a_duplicated_pair_names_the_pair(tmp_path):
    """A metric-learning pair whose two inputs are the same sample: distance 0, sqrt's
    derivative at 0 is inf. Two such pairs in a batch of 16: both rows named."""

    def batches(s):
        x1, y = R.batch(s, n=16)
        x2, _ = R.batch(100 + s, n=16)
        if s == K:
            x2[[3, 11]] = x1[[3, 11]]
        return [((x1, x2), y)]

    err = train(C, "make_siamese_net", batches, tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="dist", op="SqrtBackward0",
          samples=[3, 11], cause="invalid", reproduced=True)
    assert rep["origin"]["made"] in ("+inf", "-inf", "nan")


def test_backward_samples_in_the_micro_batch_that_made_them(tmp_path):
    """Gradient accumulation over three micro-batches; a zero row in the second (rows of
    that micro-batch, and its index, are named)."""

    def batches(s):
        mbs = []
        for i in range(3):
            x, y = R.batch(10 * s + i)
            if s == K and i == 1:
                x[2] = 0.0
            mbs.append(((x,), y))
        return mbs

    err = train(C, "make_where_net", batches, tmp_path)
    rep = nanreplay_json(err.bundle_path)
    check(rep, step=K, phase="backward", module="logf", op="LogBackward0", samples=[2],
          micro_batch=1, cause="invalid", reproduced=True)
