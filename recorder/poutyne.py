"""Poutyne integration: the flight recorder as a ``poutyne.Callback``.

    from recorder.poutyne import FlightRecorderCallback

    model = poutyne.Model(network, "adam", nn.CrossEntropyLoss(), batch_metrics=["accuracy"])
    model.fit_generator(train_loader, valid_loader, epochs=10, callbacks=[
        FlightRecorderCallback(factory="mypkg.models:make_network")])
    # raises NonFiniteError(bundle_path=...) at the first event

The recorder attaches when training begins (``fit``, ``fit_generator``, ``fit_dataset``,
``Experiment.train``) to ``model.network`` with ``model.optimizer`` and, as its loss, the loss
Poutyne calls: ``model.loss_function`` wraps a loss that is not a Poutyne metric in a
``DecomposableMetric`` (which averages it over the epoch); the user's loss module inside it is
recorded, else (a plain function, a string Poutyne resolved) the wrapper itself, a module whose
call the recorder hooks. Poutyne calls no callback when ``fit`` raises (``on_train_end`` is
skipped): the callback runs the model's per-batch methods (``_fit_batch``,
``_fit_batch_n_batches_per_step``, ``_validate``, wrapped on the instance, unwrapped at detach)
under the recorder's exception check, so the step an exception cut short is checked and
bundled, the exception goes on with the recorder's summary as a note, and no hook is left on
the network. A later ``fit`` of the same network numbers its steps on from this one's. Importing
this module needs ``poutyne``; nothing else in ``recorder`` does.
"""

from __future__ import annotations

from typing import Any

from poutyne import Callback
from torch import nn

from .checked_run import Wrappers
from .flight import FlightRecorder
from .settings import check_callback_options

# the Model's methods a training step or a validation pass runs in (looked up on the instance)
_WRAPPED = ("_fit_batch", "_fit_batch_n_batches_per_step", "_validate")


def poutyne_loss(model) -> Any:
    """The loss module the recorder hooks: the user's loss module inside Poutyne's
    ``DecomposableMetric`` wrapper, else ``model.loss_function`` itself."""
    loss = model.loss_function
    inner = getattr(loss, "func", None)
    if type(loss).__name__ == "DecomposableMetric" and isinstance(inner, nn.Module):
        return inner
    return loss


class FlightRecorderCallback(Callback):
    """Records every step of a Poutyne ``Model``'s fit; ``options`` are :class:`FlightRecorder`'s
    keyword arguments (``out_dir``, ``factory``, ``on_event``, ``allow_inf``, ...), checked now.
    The loss is the one Poutyne calls (see the module's text) unless ``loss_fn`` names another.
    ``self.recorder`` is the recorder of the current (or last) fit."""

    def __init__(self, **options: Any):
        check_callback_options(options.get("loss_fn"), options)
        super().__init__()
        self.options = options
        self.recorder: FlightRecorder | None = None
        self._wrappers = Wrappers()  # (the poutyne Model's per-batch methods, until detach)
        self._network = None  # the network the last recorder recorded

    def on_train_begin(self, logs: dict) -> None:
        self.detach()  # (a fit after one that raised)
        model = self.model
        options = dict(self.options)
        loss_fn = options.pop("loss_fn", None) or poutyne_loss(model)
        last = self.recorder
        start = last.step if last is not None and self._network is model.network else 0
        self._network = model.network
        self.recorder = FlightRecorder(model.network, model.optimizer, loss_fn=loss_fn,
                                       start_step=start, **options)
        self.recorder.integration = "poutyne"
        self.recorder.attach()
        for name in _WRAPPED:
            self._wrappers.check(self, model, name)

    def on_train_end(self, logs: dict) -> None:
        if self.recorder is not None:  # the open step, and the last update's weights
            try:
                self.recorder.__exit__(None, None, None)
            finally:
                self.detach()

    def detach(self) -> None:
        """Remove the recorder's hooks and the wrappers of the model's methods."""
        self._wrappers.undo()
        if self.recorder is not None:
            self.recorder.detach()
