"""The user's own ops: a ``torch.library.custom_op`` (a fused kernel with a Python
implementation, its fake and autograd formula), one writing into an ``out`` buffer, and an
``autograd.Function`` with a hand-written backward. Each planted bug zeroes one record at step
K; the report must name the custom op (in its own namespace), the line inside it that made the
NaN, and that record."""

from __future__ import annotations

from pathlib import Path

import custom_ops_models as C
import pytest
import torch
from bundles import check_report, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K, ROW = 3, 5

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line(text: str) -> str:
    lines = (HERE / "custom_ops_models.py").read_text().splitlines()
    return f"custom_ops_models.py:{next(i for i, t in enumerate(lines, 1) if text in t)}"


def _train(factory: str, out_dir: Path | None, steps: int = 5, blank: bool = True):
    """SGD with cross entropy on ``custom_ops_models.<factory>()``; at step K record ROW is
    all 0 when ``blank``. Returns the losses, or the NonFiniteError."""
    model = getattr(C, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit, losses = nn.CrossEntropyLoss(), []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"custom_ops_models:{factory}") if out_dir else None
    try:
        with rec if rec else torch.enable_grad():
            for step in range(steps):
                x, y = C.batch(step)
                if blank and step == K:
                    x[ROW] = 0.0
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e
    return losses


@pytest.mark.parametrize("factory, op, call, inner", [
    ("make_normed", "userops.fused_norm", "torch.ops.userops.fused_norm(x)",
     "return x / x.norm(dim=-1, keepdim=True)"),
    ("make_scaled", "userops.scale_into", "torch.ops.userops.scale_into(x,", "out.copy_(x / scale)"),
])
def test_a_custom_ops_own_division_names_the_op_its_line_and_the_record(tmp_path, factory, op,
                                                                         call, inner):
    """The custom op divides record ROW's zeros by their zero norm (or largest magnitude). The
    report named 'aten.fused_norm' (torch's namespace for a user's op) with a hint of a pole
    'of 0', and for the op writing into ``out`` (it returns nothing) no op at all. It names the
    op in its own namespace at its call, the 0/0 of the aten.div inside it and that line."""
    err = _train(factory, tmp_path)
    assert isinstance(err, NonFiniteError) and err.event["phase"] == "forward", err
    rep = nanreplay_json(err.bundle_path)
    check_report(rep, step=K, phase="forward", module="0", op=op, samples=[ROW], cause="invalid",
           reproduced=True, source=_line(call))
    assert rep["hint"].startswith("aten.div of 0 by 0 (0/0)"), rep["hint"]
    assert any(p.startswith(f"{op} is a custom op: its own code made the nan, aten.div at "
                            f"{_line(inner)} ({inner}") for p in rep["problems"]), rep["problems"]


def test_a_custom_functions_backward_nan_in_a_parameters_gradient_names_the_record(tmp_path):
    """Gain's hand-written backward divides by the saved input, 0 in record ROW, and sums over
    the batch into the gain's gradient: the node's gradients hold no batch rows, so the report
    named no sample. The rows of the backward's own aten.div are named."""
    err = _train("make_gained", tmp_path)
    assert isinstance(err, NonFiniteError) and err.event["phase"] == "backward", err
    rep = nanreplay_json(err.bundle_path)
    check_report(rep, step=K, phase="backward", module="0", op="GainBackward", samples=[ROW],
           cause="invalid", reproduced=True, source=_line("Gain.apply(x, self.g)"))
    assert "its backward's aten.div has a pole" in rep["hint"], rep["hint"]
    assert any(f"aten.div at {_line('grad * y * g / x')}" in p for p in rep["problems"])


def test_training_through_custom_ops_is_unchanged_by_the_recorder(tmp_path):
    """All three ops in one healthy model: the same losses bit for bit, and no event."""
    plain = _train("make_all", None, steps=3, blank=False)
    recorded = _train("make_all", tmp_path, steps=3, blank=False)
    assert plain == recorded and len(plain) == 3
    assert not list(tmp_path.glob("*.nan"))
