"""End to end on PyTorch features training code uses rarely (``rare_features_models``):
multi-gradient hooks, a ``differentiable=True`` inner optimizer (Meta-SGD), a model made by
``torch.export`` and fine-tuned, ``parametrize`` with ``unsafe=True``, a mean teacher's weights
swapped in by ``functional_call``. Healthy runs raise no event and compute bit-identical
losses with and without the recorder; planted bugs are named with their step, module or
parameter, op, rows and cause."""

from __future__ import annotations

import pytest
import rare_features_models as M
import torch
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

BATCH, STEPS = 16, 5
FACTORIES = {"multi_grad_hooks": "make_mlp", "unsafe_parametrize": "make_unsafe",
             "meta_sgd": "make_meta_sgd", "exported": "make_exported", "mean_teacher": "make_mlp"}


def _run(kind, data, out_dir, *, record=True, teacher_bug=None, teacher_first=False):
    """``STEPS`` steps of the ``kind`` loop over ``data``: the losses, or the recorder's
    ``NonFiniteError``. ``teacher_first``: the teacher's forward before the student's."""
    model = getattr(M, FACTORIES[kind])()
    if kind == "multi_grad_hooks":
        M.log_gradients(model, [])
    teacher = M.MeanTeacher(model, teacher_bug) if kind == "mean_teacher" else None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"rare_features_models:{FACTORIES[kind]}") if record else None
    x, y, losses = *data, []
    try:
        if rec is not None:
            rec.attach()
        for step in range(STEPS):
            xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
            opt.zero_grad()
            if kind == "meta_sgd":
                loss = M.meta_sgd_loss(model, crit, xb, yb)
            else:
                target = teacher.targets(model, xb) if teacher_first else None
                out = model(xb)
                loss = crit(out, yb)
                if teacher is not None:
                    target = teacher.targets(model, xb) if target is None else target
                    loss = loss + (out.softmax(-1) - target).pow(2).mean()
            loss.backward()
            opt.step()
            if teacher is not None:
                teacher.update(model, step)
            losses.append(loss.detach())
        if rec is not None:
            rec.detach()
            assert rec.event is None
    except NonFiniteError as e:
        return e
    return torch.stack(losses)


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_rare_feature_training_is_bit_identical_and_raises_no_event(tmp_path, kind):
    """Multi-gradient hooks, Meta-SGD's differentiable inner SGD, the exported module, unsafe
    parametrizations and the teacher's functional_call train the same under the recorder."""
    plain = _run(kind, M.data(n=BATCH * STEPS), tmp_path, record=False)
    recorded = _run(kind, M.data(n=BATCH * STEPS), tmp_path)
    assert isinstance(recorded, torch.Tensor), recorded
    assert torch.isfinite(plain).all() and torch.equal(plain, recorded)


@pytest.mark.parametrize("kind", ["multi_grad_hooks", "unsafe_parametrize", "meta_sgd"])
def test_a_nan_record_is_an_input_event_at_its_step_and_row(tmp_path, kind):
    """A missing value read as NaN in record 37: step 37 // BATCH, row 37 % BATCH (Meta-SGD's
    inner step takes the batch's first half, where that row is)."""
    row = 37
    err = _run(kind, M.data(n=BATCH * STEPS, nan_row=row), tmp_path)
    assert isinstance(err, NonFiniteError), err
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["tensor"], o["samples"], rep["cause"]) == (
        row // BATCH, "input", "batch", [row % BATCH], "input"), rep


def test_an_exported_module_fine_tuned_replays_its_0_by_0(tmp_path):
    """A blank record (row 37) standardised by its std of 0 in the exported graph, whose ops
    run in the root (no submodule calls). The replay crashed: it called the exported module's
    train(), which torch.export refuses (``Calling train() is not supported yet.``); its source
    line is the traced model's, not the graph's generated ``<eval_with_key>`` code."""
    row = 37
    err = _run("exported", M.data(n=BATCH * STEPS, constant_row=row), tmp_path)
    assert isinstance(err, NonFiniteError), err
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"], rep["reproduced"]) == (
        row // BATCH, "forward", "", "aten.div", [row % BATCH], "invalid", True), rep
    assert o["source"] == source_line("rare_features_models.py", "return (x - mean) / x.std")


@pytest.mark.parametrize("teacher_first", [True, False])
def test_a_nan_teacher_weight_swapped_in_by_functional_call_names_the_ema_update(
        tmp_path, teacher_first):
    """The teacher's EMA update with a NaN decay after step 2 makes every teacher weight NaN;
    its functional_call forward (gradients off) in step 3 meets them. Teacher first, the
    recorder finds them as the step's weights: the report said the loop replaced every
    parameter (a load_state_dict(..., assign=True)) and to rebuild the optimizer; now it names
    the EMA update and the tensors functional_call passed in. Student first, a forward event
    of micro-batch 1 that the bundle's weights cannot reproduce: its hint named a MAML inner
    learning rate; now the teacher's update."""
    bad = 2
    err = _run("mean_teacher", M.data(n=BATCH * STEPS), tmp_path, teacher_bug=bad,
               teacher_first=teacher_first)
    assert isinstance(err, NonFiniteError), err
    rep = nanreplay_json(err.bundle_path, code=None)
    o = rep["origin"]
    assert "t.mul_(m).add_(s, alpha=1 - m)" in rep["hint"], rep["hint"]
    assert "replaced every parameter" not in rep["hint"]
    assert "inner learning rate" not in rep["hint"]
    if teacher_first:
        assert (rep["event"]["step"], o["phase"], o["param"], rep["cause"]) == (
            bad + 1, "weights", "fc1.weight", "weights"), rep
        assert any("torch.func.functional_call passed in" in p for p in rep["problems"])
    else:
        assert (rep["event"]["step"], o["phase"], o["module"], o["micro_batch"],
                rep["reproduced"]) == (bad + 1, "forward", "fc1", 1, False), rep
        assert any("mean teacher" in p for p in rep["problems"])
