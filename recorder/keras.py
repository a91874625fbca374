"""Keras 3 integration (the PyTorch backend): the flight recorder as a ``keras.callbacks.Callback``.

    os.environ["KERAS_BACKEND"] = "torch"
    from recorder.keras import FlightRecorderCallback

    model.compile(optimizer="adam", loss=my_loss)
    model.fit(x, y, callbacks=[FlightRecorderCallback(factory="mypkg.models:make_model")])

Under the PyTorch backend a Keras model is an ``nn.Module`` whose ``__call__`` reaches torch's
(with its hooks), and ``fit`` runs ``loss.backward()`` then the Keras optimizer's ``apply``,
which is no ``torch.optim.Optimizer``. So the recorder is attached with no optimizer: each
training forward is a step, closed when its backward ends, before the update. It attaches when
training begins, after ``fit`` traced the model on the meta device (a call the recorder must
not see), and numbers steps on from ``model.optimizer.iterations``. The model's
``compute_loss`` (the compiled loss plus ``add_loss`` terms; or an override of it) is called
through the recorder's ``loss_fn`` unless ``loss_fn`` is given, so a non-finite loss is a
``loss`` event. Keras calls no callback when ``fit`` raises: the callback runs the model's
``train_function`` under the recorder's exception check (wrapped on the instance, put back at
detach), so the step an exception cut short is checked and bundled and no hook is left on the
model. A ``LossScaleOptimizer``'s skipped updates (``mixed_float16``) are no events. Importing this module needs ``keras``; nothing else in ``recorder`` does.
"""

from __future__ import annotations

from typing import Any

import keras

from .checked_run import Wrappers
from .flight import FlightRecorder
from .settings import check_callback_options


class FlightRecorderCallback(keras.callbacks.Callback):
    """Records every ``model.fit()`` step; ``options`` are :class:`FlightRecorder`'s keyword
    arguments (``out_dir``, ``factory``, ``on_event``, ``allow_inf``, ...), checked now.
    ``stats`` is ``"full"`` unless given: the recorder sees no update of the Keras optimizer,
    so each step's parameter norm is the only record of what the update before it did (a
    learning rate that blew the weights up in one update: the overflow's hint says the run
    was diverging). ``self.recorder`` is the recorder of the current (or last) ``fit``."""

    def __init__(self, **options: Any):
        super().__init__()
        check_callback_options(options.get("loss_fn"), options)
        self.options = options
        self.recorder: FlightRecorder | None = None
        self._wrappers = Wrappers()  # (on the model and its optimizer, until detach)

    def on_train_begin(self, logs=None) -> None:
        self.detach()  # (a fit after one that raised)
        model = self.model
        options = {"stats": "full", **self.options}  # (see the class)
        loss_fn = options.pop("loss_fn", None)
        optimizer = getattr(model, "optimizer", None)
        step = int(optimizer.iterations) if optimizer is not None else 0
        self.recorder = rec = FlightRecorder(model, None, start_step=step,
                                             loss_fn=loss_fn or model.compute_loss, **options)
        rec.integration = "keras"
        rec.attach()
        if loss_fn is None:
            self._wrappers.wrap(model, "compute_loss", _through(rec))
        self._wrappers.check(self, model, "train_function")
        # (fit's validation: its forwards are evaluations between the steps, checked as they
        # return; an event there leaves fit through evaluate)
        self._wrappers.check(self, model, "evaluate")
        if callable(getattr(optimizer, "check_finite", None)) \
                and callable(getattr(optimizer, "scale_loss", None)):
            self._scaled(rec, optimizer)

    def _scaled(self, rec: FlightRecorder, optimizer) -> None:
        """A ``LossScaleOptimizer`` (Keras's ``mixed_float16`` policy compiles one in) skips the
        update whose scaled gradients overflowed and lowers its scale: that is no event. A step
        whose loss it scaled is left open past its backward and closed as ``apply`` begins,
        as one the loop's scaler skipped when a gradient is not finite (its forward and loss
        checked; more than ``max_skipped_steps`` skips in a row an event), else checked as
        usual."""
        scale_loss, apply = optimizer.scale_loss, optimizer.apply

        def scaled(loss):
            tape = rec.cycle.tape
            if tape is not None and rec.health.active:
                tape.close_queued = True  # (so its backward does not close it)
            return scale_loss(loss)

        def applied(grads, *args, **kwargs):
            rec.end_step(skipped=not bool(optimizer.check_finite(grads)))
            return apply(grads, *args, **kwargs)

        self._wrappers.wrap(optimizer, "scale_loss", scaled)
        self._wrappers.wrap(optimizer, "apply", applied)

    def on_train_end(self, logs=None) -> None:
        if self.recorder is not None:  # the open step, and the last update's weights
            self.recorder.__exit__(None, None, None)
        self.detach()

    def detach(self) -> None:
        """Remove the recorder's hooks and the wrappers of the model's methods."""
        self._wrappers.undo()
        if self.recorder is not None:
            self.recorder.detach()


def _through(rec: FlightRecorder):
    """The model's ``compute_loss`` called as the recorder's ``loss_fn``."""
    def compute_loss(*args, **kwargs):
        return rec.loss_fn(*args, **kwargs)
    return compute_loss
