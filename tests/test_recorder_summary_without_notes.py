"""Python 3.10's path for the summary of a step cut short by an exception: exceptions there
have no ``add_note`` (PEP 678 is 3.11), so the recorder logs the summary instead (guide,
"Recording": "the loop's exception goes on with the recorder's summary added as a note
(``exc.__notes__``; on Python 3.10 it is logged)").

Simulated on any Python by the one thing that differs: the loop raises an exception whose
instances have no ``add_note`` attribute, so ``hasattr(exc, "add_note")`` is false as it is
on 3.10. Everything else is the real recorder on a real loop.
"""

from __future__ import annotations

import logging

import models as M
import pytest
import torch
from ci import NEEDS_PY311
from models import bundles
from torch import nn

from recorder import FlightRecorder


class LossGuardError(ValueError):
    """The loop's own NaN guard, raised as Python 3.10 makes exceptions: without add_note."""

    @property
    def add_note(self):
        raise AttributeError("add_note")


class NotedLossGuardError(ValueError):
    """The same guard where exceptions take notes (3.11+)."""


def guarded_loop(model, opt, crit, error=LossGuardError, steps=4):
    for step in range(steps):
        x, y = M.batch(step)
        if step == 2:
            x[3, 0] = float("nan")
        opt.zero_grad()
        loss = crit(model(x), y)
        if not torch.isfinite(loss):
            raise error(f"loss is {loss.item()} at step {step}")
        loss.backward()
        opt.step()


def _run(out_dir, caplog, on_event, error):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), nn.ReLU(), nn.Linear(M.HIDDEN, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with pytest.raises(error, match="loss is nan at step 2") as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event=on_event):
                guarded_loop(model, opt, crit, error)
    [bundle] = bundles(out_dir)
    assert bundle.name == "step00000002-rank0.nan"
    logged = [r.getMessage() for r in caplog.records
              if r.name == "nanreplay" and str(bundle) in r.getMessage()]
    assert all("at step 2, phase input" in s for s in logged), logged
    return info.value, logged


@pytest.mark.parametrize("on_event", ["raise", "warn"])
def test_the_summary_is_logged_when_the_exception_takes_no_note(out_dir, caplog, on_event):
    assert not hasattr(LossGuardError("x"), "add_note")
    exc, logged = _run(out_dir, caplog, on_event, LossGuardError)
    assert not hasattr(exc, "__notes__")  # nothing could be noted on the exception
    # warn mode logs the event when it is found, and the summary for the exception
    assert len(logged) == (1 if on_event == "raise" else 2), logged


@pytest.mark.skipif(not hasattr(ValueError(), "add_note"), reason=NEEDS_PY311)
@pytest.mark.parametrize("on_event", ["raise", "warn"])
def test_control_with_notes_the_summary_is_a_note_not_a_log_line(out_dir, caplog, on_event):
    exc, logged = _run(out_dir, caplog, on_event, NotedLossGuardError)
    [note] = exc.__notes__
    assert "at step 2, phase input" in note
    # the batch brought it: no module "first made" it
    assert "It came in with the input of '<root>' (micro-batch 0). Tensor batch, samples [3]." \
        in note and "First made" not in note, note
    assert len(logged) == (0 if on_event == "raise" else 1), logged
