"""A module the forward calls from more than one line: the report names the line of the call
that made the first non-finite value (``origin.called_at``), beside its call number."""

from __future__ import annotations

import called_at_models as M
import pytest
import torch
from bundles import invoke_cli, nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, blank_at: int | None, make: str = "make_model"):
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"called_at_models:{make}"):
        for step in range(4):
            q, p = M.batch(step, blank=3 if step == blank_at else None)
            opt.zero_grad()
            loss = crit(model(q, p), torch.arange(6))
            loss.backward()
            opt.step()


def test_the_second_call_of_a_shared_module_names_its_line(tmp_path):
    """The passages' call of the shared ``norm`` (its call 1) makes 0/0 on passage 3: the
    origin is that call, on its op's line, with the line that called it (not the queries')."""
    with pytest.raises(NonFiniteError) as info:
        _train(tmp_path, blank_at=2)
    rep = nanreplay_json(info.value.bundle_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["call"], o["op"]) == (2, "norm", 1, "aten.div"), o
    assert o["source"] == source_line("called_at_models.py", "return x / x.norm("), o
    assert o["called_at"] == source_line("called_at_models.py", "p = self.norm("), o
    assert rep["cause"] == "invalid", rep["cause"]
    assert "call 1 (called at called_at_models.py:" in invoke_text(info.value.bundle_path)


def test_a_module_called_again_from_one_line_gets_no_caller_line(tmp_path):
    """Control: the same tower applied in a loop calls ``norm`` twice from one line, which a
    caller's line cannot tell apart: the call number alone names it."""
    with pytest.raises(NonFiniteError) as info:
        _train(tmp_path, blank_at=2, make="make_loop_model")
    o = nanreplay_json(info.value.bundle_path)["origin"]
    assert (o["module"], o["call"], o["op"]) == ("norm", 1, "aten.div"), o
    assert "called_at" not in o, o


def invoke_text(bundle) -> str:
    """The text report of ``nanreplay BUNDLE``."""
    return invoke_cli(str(bundle)).output
