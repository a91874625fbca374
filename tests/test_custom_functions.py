"""``torch.autograd.Function``s written with the less common APIs: a new-style Function
(``setup_context``), an in-place one (``mark_dirty``), one whose backward is
``@once_differentiable`` and an argmax straight-through estimator returning its index too
(``mark_non_differentiable``, ``set_materialize_grads(False)``). A planted record at step K
makes the Function's own forward take the log of a negative, or its own backward divide by a
saved 0; the report must name the Function's module, op, line, that record and the cause."""

from __future__ import annotations

from pathlib import Path

import custom_fn_models as C
import pytest
import torch
from bundles import check_report, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent
K, ROW = 2, 5

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _line(text: str) -> str:
    lines = (HERE / "custom_fn_models.py").read_text().splitlines()
    return f"custom_fn_models.py:{next(i for i, t in enumerate(lines, 1) if text in t)}"


def _train(factory: str, out_dir: Path | None, plant: float | None, steps: int = 4):
    """SGD with cross entropy on ``custom_fn_models.<factory>()``; at step K record ROW is
    all ``plant`` (None: no plant). Returns the losses, or the NonFiniteError."""
    model = getattr(C, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit, losses = nn.CrossEntropyLoss(), []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"custom_fn_models:{factory}") if out_dir else None
    try:
        with rec if rec else torch.enable_grad():
            for step in range(steps):
                x, y = C.batch(step)
                if plant is not None and step == K:
                    x[ROW] = plant
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e
    return losses


@pytest.mark.parametrize("factory, module, op, inner", [
    ("make_compressed", "0", "aten.log", "return torch.log(1 + x)"),
    ("make_inplace", "1", "aten.log1p_", "x.log1p_()"),
    ("make_raw_inplace", "0", "aten.log1p_", "x.log1p_()"),
])
def test_a_functions_forward_log_of_a_negative_names_its_line_and_the_record(tmp_path, factory,
                                                                               module, op, inner):
    """Record ROW is -3 at step K: the Function's forward takes the log of a negative. The
    in-place one straight on the batch: the recorder, reading the call's input after the call
    wrote into it, names the root; the re-run named the Function's module but called the
    event not reproduced (exit 1). It is the same event, seen closer, and a note says so."""
    err = _train(factory, tmp_path, plant=-3.0)
    assert isinstance(err, NonFiniteError) and err.event["phase"] == "forward", err
    rep = nanreplay_json(err.bundle_path)
    check_report(rep, step=K, phase="forward", module=module, op=op, samples=[ROW], cause="invalid",
           reproduced=True, source=_line(inner))
    in_place = [p for p in rep["problems"] if "writes its output into the tensor it was given"
                in p]
    assert len(in_place) == (rep["event"]["module"] != module), rep["problems"]


def test_a_once_differentiable_backward_dividing_by_a_saved_zero_names_the_record(tmp_path):
    """Record ROW is all 0 at step K: RowNorm's clipped backward divides it by its zero norm."""
    err = _train("make_normed", tmp_path, plant=0.0)
    assert isinstance(err, NonFiniteError) and err.event["phase"] == "backward", err
    rep = nanreplay_json(err.bundle_path)
    check_report(rep, step=K, phase="backward", module="1", op="RowNormBackward", samples=[ROW],
           cause="invalid", reproduced=True, source=_line("RowNorm.apply(x)"))
    assert any(f"aten.div at {_line('grad * x / n')}" in p for p in rep["problems"]), rep


def test_a_straight_through_estimators_backward_dividing_by_zero_names_the_record(tmp_path):
    """Record ROW is all 0 at step K: ArgmaxSTE, which also returns its (non-differentiable)
    index and leaves grads unmaterialized, divides by the zero scale of that row's logits."""
    err = _train("make_coded", tmp_path, plant=0.0)
    assert isinstance(err, NonFiniteError) and err.event["phase"] == "backward", err
    rep = nanreplay_json(err.bundle_path)
    check_report(rep, step=K, phase="backward", module="1", op="ArgmaxSTEBackward", samples=[ROW],
           cause="invalid", reproduced=True, source=_line("ArgmaxSTE.apply("))
    assert any(f"aten.div at {_line('return g / scale')}" in p for p in rep["problems"]), rep


def test_training_through_custom_functions_is_unchanged_by_the_recorder(tmp_path):
    """All four Functions in one healthy model: the same losses bit for bit, and no event."""
    plain = _train("make_all", None, plant=None, steps=3)
    recorded = _train("make_all", tmp_path, plant=None, steps=3)
    assert plain == recorded and len(plain) == 3
    assert not list(tmp_path.glob("*.nan"))
