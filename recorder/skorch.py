"""skorch integration: the flight recorder as a skorch ``Callback``.

    from recorder.skorch import FlightRecorderCallback

    net = NeuralNetClassifier(MyModule, callbacks=[
        FlightRecorderCallback(factory="mypkg.models:make_module")])
    net.fit(X, y)          # raises NonFiniteError(bundle_path=...) at the first event

skorch builds the module, optimizer and criterion in ``initialize()`` (again at each ``fit``
unless ``warm_start``), so the recorder attaches when training begins, to ``net.module_`` with
``net.optimizer_`` and ``net.criterion_`` as its loss, and detaches when training ends. skorch
calls no callback when ``fit`` raises (``on_train_end`` is skipped): the callback runs the net's
``fit_loop`` under the recorder's exception check (wrapped on the instance, unwrapped at
detach), so the step an exception cut short (the module's own NaN check in its forward, a
``clip_grad_norm_(error_if_nonfinite=True)`` in an overridden ``train_step``) is checked and
bundled, the exception goes on with the recorder's summary as a note, and no hook is left on
the module. Importing this module needs ``skorch``; nothing else in ``recorder`` does.
"""

from __future__ import annotations

from typing import Any

from skorch.callbacks import Callback

from .checked_run import Wrappers
from .flight import FlightRecorder
from .settings import check_callback_options


class FlightRecorderCallback(Callback):
    """Records every ``net.fit()`` step; ``options`` are :class:`FlightRecorder`'s keyword
    arguments (``out_dir``, ``factory``, ``on_event``, ``allow_inf``, ...), checked now. The
    loss is the net's criterion unless ``loss_fn`` names another; steps are numbered on from
    the training batches the net's history holds (``warm_start`` or ``partial_fit`` goes on
    training). ``self.recorder`` is the recorder of the current (or last) ``fit``."""

    def __init__(self, **options: Any):
        check_callback_options(options.get("loss_fn"), options)
        self.options = options
        self.recorder: FlightRecorder | None = None
        self._wrappers = Wrappers()  # (the net's fit_loop, until detach)

    def on_train_begin(self, net, X=None, y=None, **kwargs) -> None:
        self.detach()  # (a fit after one that raised)
        options = dict(self.options)
        loss_fn = options.pop("loss_fn", None) or net.criterion_
        batches = sum(1 for epoch in net.history for b in epoch.get("batches", ())
                      if "train_loss" in b)
        self.recorder = FlightRecorder(net.module_, net.optimizer_, loss_fn=loss_fn,
                                       start_step=batches, **options)
        self.recorder.integration = "skorch"
        self.recorder.attach()
        self._wrappers.check(self, net, "fit_loop")

    def on_train_end(self, net, X=None, y=None, **kwargs) -> None:
        if self.recorder is not None:  # the open step, and the last update's weights
            self.recorder.__exit__(None, None, None)
        self.detach()

    def detach(self) -> None:
        """Remove the recorder's hooks and the wrapper of the net's ``fit_loop``."""
        self._wrappers.undo()
        if self.recorder is not None:
            self.recorder.detach()
