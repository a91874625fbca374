"""PyTorch-Ignite integration: the recorder's open step closed when an ``Engine`` run stops.

    from recorder.ignite import CloseStepOnStop

    with FlightRecorder(model, optimizer, loss_fn=loss_fn, out_dir="nan-bundles") as rec:
        CloseStepOnStop(rec).attach(trainer)
        trainer.run(loader, max_epochs=10)      # raises NonFiniteError at the first event

``create_supervised_trainer(..., gradient_accumulation_steps=k)`` calls ``optimizer.step()``
every k iterations; the recorder checks a step there, once (its one host read). A NaN loss in
an earlier micro-batch is seen first by ``TerminateOnNan`` (it reads each iteration's loss),
which ends the run quietly: the step stays open and its event comes only when the ``with``
block exits (or never, with ``detach()``), after whatever the script does next. This handler
closes the open step on ``Events.TERMINATE`` and ``Events.COMPLETED`` (a last micro-batch
no ``step()`` followed), so the event is raised by ``trainer.run`` itself, through ignite's
``EXCEPTION_RAISED``. Importing this module needs ``ignite``; nothing else in ``recorder``
does.
"""

from __future__ import annotations

from typing import Any

from ignite.engine import Engine, Events

from .flight import FlightRecorder


class CloseStepOnStop:
    """Calls ``recorder.end_step()`` when the engine it is attached to terminates or completes
    (a step already closed by ``optimizer.step()`` is not closed again)."""

    def __init__(self, recorder: FlightRecorder):
        if not isinstance(recorder, FlightRecorder):
            raise TypeError(f"CloseStepOnStop needs a FlightRecorder, not "
                            f"{type(recorder).__name__}")
        self.recorder = recorder

    def attach(self, engine: Engine) -> None:
        for event in (Events.TERMINATE, Events.COMPLETED):
            if not engine.has_event_handler(self, event):
                engine.add_event_handler(event, self)

    def __call__(self, engine: Engine, *_: Any) -> None:
        self.recorder.end_step()
