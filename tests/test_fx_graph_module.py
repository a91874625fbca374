"""torch.fx ``GraphModule``s (``symbolic_trace``): their class's ``__call__`` is torch.fx's
``call_wrapped``, which reaches ``nn.Module.__call__`` through ``self._wrapped_call``. The
recorder warned at build that such a model "runs forward without torch's module hooks ... nothing
is recorded" while it recorded every call (``recorder/unhooked_call.py`` now follows a held
callable object); and the replay's source line was the generated ``def forward(self, x, w):``
(the module's definition, for want of a user frame: generated code was skipped) instead of the
generated line of the op (``replay/source.py``)."""

from __future__ import annotations

import logging

import fx_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.unhooked_call import bypassing_class

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _loop(model, opt, crit, zero_weight_at=None) -> list[float]:
    losses = []
    for x, w, y in M.batches(5, zero_weight_at):
        opt.zero_grad()
        loss = crit(model(x, w), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_traced_model_is_recorded_and_its_division_named_at_its_line(out_dir, caplog):
    """Record 4 of step 3 has weight 0: ``relu / 0`` makes NaN (0/0 where the ReLU is 0,
    +inf elsewhere) in the root's generated forward, for sample 4: invalid."""
    model = M.make_traced()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.MSELoss()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="fx_models:make_traced"):
                _loop(model, opt, crit, zero_weight_at=(3, 4))
    assert not [r for r in caplog.records if "module hooks" in r.getMessage()], caplog.text
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    rep = nanreplay_json(info.value.bundle_path, code=0)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "", "aten.div", [4], "invalid"), (o, rep["cause"])
    path, _, line = o["source"].rpartition(":")
    assert path.startswith("<eval_with_key>") and "fx_models.py" in path, o["source"]
    assert "truediv = relu / unsqueeze" in model.code.splitlines()[int(line) - 1]


def test_a_healthy_traced_run_trains_as_without_the_recorder(out_dir):
    plain = _loop(model := M.make_traced(), torch.optim.SGD(model.parameters(), lr=0.1),
                  nn.MSELoss())
    model = M.make_traced()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        assert _loop(model, opt, crit) == plain
    assert rec.event is None


def test_a_call_that_runs_forward_itself_is_still_said():
    """The rule followed by the above stays narrow: a ``__call__`` that runs ``forward``
    itself (GPyTorch's) bypasses the hooks, and is said."""
    class Direct(nn.Linear):
        def __call__(self, x):
            return self.forward(x)

    assert bypassing_class(Direct(2, 2)) is Direct
    assert bypassing_class(M.make_traced()) is None
