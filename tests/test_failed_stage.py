"""A stage of the replay's analysis raising (torch's own code under a watching mode, or a bug
of ours) degrades the report to what is known, not 'replay failed': the recorder's step,
phase, module and samples, ``reproduced`` from the plain re-run, the cause left unknown, a
note naming the stage and the error. The model's own code raising keeps its own error."""

from __future__ import annotations

import higher_order_models as M
import pytest
import torch

import replay.analyze as analyze
import replay.backward_report as backward_report
from recorder import FlightRecorder, NonFiniteError
from replay import replay
from replay.failed_stage import Known, kept_going

pytestmark = pytest.mark.usefixtures("in_tests_dir")
ROW = 2


def train(out_dir, factory: str, plant=None) -> NonFiniteError:
    torch.manual_seed(0)
    model = getattr(M, factory)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=torch.nn.functional.mse_loss, out_dir=out_dir,
                            factory=f"higher_order_models:{factory}") as rec:
            for step in range(3):
                x, y = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
                if plant is not None and step == 1:
                    plant(x)
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    return info.value


def test_backward_finder_failing_keeps_the_recorded_origin(tmp_path, monkeypatch):
    err = train(tmp_path, "make_cond_root")
    # every row has a minimum: sqrt's gradient at 0 is NaN in the first step's backward
    assert (err.event["step"], err.event["phase"]) == (0, "backward"), err.event
    monkeypatch.setattr(backward_report, "find_backward_origin", _RAISE)
    rep = replay(err.bundle_path, factory=M.make_cond_root)
    assert rep["reproduced"] is True and rep["cause"] is None, rep
    o = rep["origin"]
    assert (o["phase"], o["params"]) == ("backward", err.event["params"]), rep
    failed = rep["failed_stage"]
    assert failed["stage"].startswith("the analysis replay.backward_report"), failed
    assert failed["error"].startswith("TypeError: linalg_cholesky()"), failed
    assert "the plain re-run made the event again" in rep["hint"], rep["hint"]
    assert any("debug=True" in p and "issue" in p for p in rep["problems"]), rep["problems"]


def _zero_record(x):
    x[ROW].zero_()  # a blank record: its std 0, a 0/0 in the standardisation


# a stage failing inside torch: its op refusing the replay's arguments (the test's own
# function would be the model's code to the replay, whose errors are the user's)
_RAISE = torch.linalg.cholesky


def test_wrapper_subclass_norm_names_the_inner_div_module_samples_and_cause(tmp_path):
    # a _make_wrapper_subclass tensor: the replay's modes read the plain tensors its own
    # __torch_dispatch__ computes on (the inner aten.div), not the wrapper (no .tolist())
    err = train(tmp_path, "make_wrapped_norm", _zero_record)
    assert (err.event["step"], err.event["module"], err.event["samples"]) == (1, "norm", [ROW])
    rep = replay(err.bundle_path, factory=M.make_wrapped_norm)
    o = rep["origin"]
    # the zeroed record's std is 0: its centred 0 divided by it is 0/0
    assert (o["phase"], o["op"], o["module"], o["samples"], rep["cause"]) == (
        "forward", "aten.div", "norm", [ROW], "invalid"), rep
    assert o["source"] == f"higher_order_models.py:{_line_of('/ w.std(')}", o["source"]
    assert rep["reproduced"] is True and rep.get("failed_stage") is None, rep
    assert not rep["problems"], rep["problems"]


def _line_of(text: str) -> int:
    with open(M.__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_any_failed_stage_keeps_step_module_samples_and_reproduction(tmp_path, monkeypatch):
    err = train(tmp_path, "make_subclass_norm", _zero_record)
    assert (err.event["step"], err.event["module"], err.event["samples"]) == (1, "norm", [ROW])
    monkeypatch.setattr(analyze, "report_forward", _RAISE)  # (the op finder's report)
    rep = replay(err.bundle_path, factory=M.make_subclass_norm)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["samples"]) == (
        1, "forward", "norm", [ROW]), rep
    assert rep["reproduced"] is True and rep["cause"] is None, rep
    assert rep["failed_stage"]["error"].startswith("TypeError: linalg_cholesky()"), rep
    assert rep["failed_stage"]["stage"] == "the analysis replay.analyze._from_rerun", rep


def test_a_stage_after_the_origin_failing_keeps_the_origin_and_cause(tmp_path, monkeypatch):
    err = train(tmp_path, "make_subclass_norm", _zero_record)
    monkeypatch.setattr(analyze, "checked_eps", _RAISE)
    rep = replay(err.bundle_path, factory=M.make_subclass_norm)
    o = rep["origin"]
    assert (o["op"], o["module"], o["samples"], rep["cause"]) == (
        "aten.div", "norm", [ROW], "invalid"), rep
    assert rep["failed_stage"]["stage"].endswith("linalg_cholesky"), rep  # (the one patched)
    assert rep["failed_stage"]["error"].startswith("TypeError: linalg_cholesky()"), rep


def test_the_models_own_error_is_raised_not_degraded():
    code = compile("def forward():\n    raise ValueError('shape mismatch in my model')\n",
                   "/nonexistent/user_model.py", "exec")
    scope: dict = {}
    exec(code, scope)
    report = {"problems": []}
    with pytest.raises(ValueError, match="shape mismatch in my model"):
        kept_going(report, None, Known(), scope["forward"])
    assert report == {"problems": []}
