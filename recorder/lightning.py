"""Lightning integration: the flight recorder as a ``lightning.pytorch`` callback.

    from recorder.lightning import FlightRecorderCallback

    trainer = L.Trainer(callbacks=[FlightRecorderCallback(factory="mypkg.train:make_model")])
    trainer.fit(model, train_loader, val_loader)   # raises NonFiniteError at the first event

The recorder attaches when fitting starts (the optimizer, scheduler and GradScaler exist by
then; again when training starts if a resumed fit restored its step meanwhile) and detaches
when fitting ends or fails. It records the module whose forward the ``training_step`` calls:
the LightningModule itself (``self(x)``), or a submodule named by ``module=``
(``self.model(x)``), and the loss the ``training_step`` returns (through ``loss_fn`` when given,
so the replay can re-run it). Lightning runs each step's forward and backward inside
``optimizer.step(closure)``; the recorder checks the step when that closure returns, before the
update. Importing this module needs ``lightning``; nothing else in ``recorder`` does.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from .flight import FlightRecorder
from .pause import is_paused, pause, resume
from .settings import check_callback_options


class FlightRecorderCallback(Callback):
    """Records every training step of ``Trainer.fit``.

    Args:
        module: dotted name of the submodule the ``training_step`` calls (``"model"`` for
            ``self.model(x)``); ``None``: the LightningModule, whose ``forward`` it calls.
        loss_fn: the loss module, or the dotted name of a LightningModule attribute holding it
            (``"criterion"``), so the loss is checked (and replayed) on its own.
        options: :class:`FlightRecorder`'s other keyword arguments (``out_dir``, ``factory``,
            ``on_event``, ``allow_inf``, ...), checked now. The optimizer, scheduler, GradScaler
            and the first step's index come from the Trainer.
    """

    def __init__(self, module: str | None = None, loss_fn: Any = None, **options: Any):
        check_callback_options(None if isinstance(loss_fn, str) else loss_fn, options)
        self.module, self.loss_fn, self.options = module, loss_fn, options
        self.recorder: FlightRecorder | None = None
        self.detached_loss: float | None = None  # the step's loss, when it held no graph
        self._tuning_hook = None  # (see _tuning_check)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._attach(trainer, pl_module)  # so the sanity-check validation is watched too

    def on_train_start(self, trainer, pl_module) -> None:
        # a resumed fit restores global_step after on_fit_start: number its steps from there
        if self.recorder is None or self.recorder.step != trainer.global_step:
            self._attach(trainer, pl_module)

    def _attach(self, trainer, pl_module) -> None:
        self.detach()
        if len(trainer.optimizers) > 1:
            raise RuntimeError(f"FlightRecorderCallback: this LightningModule has "
                               f"{len(trainer.optimizers)} optimizers; the recorder follows one. "
                               "Use FlightRecorder(model, optimizer) for the one to watch")
        opt = trainer.optimizers[0] if trainer.optimizers else None
        configs = trainer.lr_scheduler_configs
        loss_fn = self.loss_fn
        if isinstance(loss_fn, str):
            loss_fn = _attribute(pl_module, loss_fn, "loss_fn")
        model = _attribute(pl_module, self.module, "module") if self.module else pl_module
        self.recorder = FlightRecorder(
            model, opt, loss_fn=loss_fn, scaler=getattr(trainer.precision_plugin, "scaler", None),
            lr_scheduler=configs[0].scheduler if len(configs) == 1 else None,
            start_step=trainer.global_step, **self.options)
        self.recorder.integration = "lightning"
        self.recorder.target.scheduler = _running_scheduler(trainer)
        self.recorder.target.unrooted_advice = (
            "Name the submodule your training_step calls with the callback's module= argument: "
            "FlightRecorderCallback(module=\"model\") for a training_step calling "
            "self.model(x)")
        self.recorder.attach()
        self._tuning_hook = model.register_forward_pre_hook(
            partial(_tuning_check, weakref.ref(self), weakref.ref(trainer)), prepend=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # back from a tuner (see _tuning_check) before the step's optimizer.step(closure),
        # whose hook must wrap the closure for the step to close before its update
        if self.recorder is not None and is_paused(self.recorder):
            resume(self.recorder)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # The training_step's loss, whatever computed it: without loss_fn (an inline F.* loss)
        # the recorder sees it only here; a NaN loss with zero gradients (every target
        # ignored) would otherwise pass unseen.
        if self.recorder is not None and self.recorder.loss_fn is None:
            self.recorder.record_loss(loss)
        self.detached_loss = _detached(loss, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.recorder is not None:
            self.recorder.end_step()  # forwards after the last update, if any
        self.detach()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.recorder is not None:  # the step the exception cut short: checked, noted
            self.recorder.cycle.check_on_exception(exception)
            if self.recorder.event is None and self.detached_loss is not None \
                    and "does not require grad" in str(exception):
                exception.add_note(_detached_note(trainer.global_step, self.detached_loss))
        self.detach()

    def detach(self) -> None:
        if self._tuning_hook is not None:
            self._tuning_hook.remove()
            self._tuning_hook = None
        if self.recorder is not None:
            self.recorder.detach()
            resume(self.recorder)  # (forgets a pause; a detached recorder stays off)


def _tuning_check(callback_ref, trainer_ref, module, args) -> None:
    """Before each forward of the recorded model (ahead of the recorder's own hook): pause the
    recorder while a tuner runs inside the fit, resume it after. Lightning's learning-rate
    finder and batch-size finder, run from a callback hook (the docs' ``LearningRateFinder``
    subclass that calls ``lr_find`` at chosen epochs), swap ``trainer.callbacks`` for their own
    during their throwaway steps, then restore the weights, the optimizer and global_step: the
    finder's loss diverges to Inf/NaN on purpose, which was an event that stopped the fit, and
    its steps shifted the recorder's numbering past global_step."""
    callback, trainer = callback_ref(), trainer_ref()
    if callback is None or trainer is None or (rec := callback.recorder) is None:
        return
    tuning = callback not in trainer.callbacks
    if tuning and not is_paused(rec):
        pause(rec)
    elif not tuning and is_paused(rec):
        resume(rec)


def _running_scheduler(trainer):
    """A getter of the one scheduler the Trainer runs when it is called, not when the recorder
    attached: a callback may swap it mid-fit (``StochasticWeightAveraging`` puts its ``SWALR``
    in place of the module's own at ``swa_epoch_start``), and the bundle describes the one
    that set the event's learning rates. The Trainer is held weakly, as the recorder holds
    the objects it was given."""
    trainer_ref = weakref.ref(trainer)

    def scheduler():
        trainer = trainer_ref()
        configs = trainer.lr_scheduler_configs if trainer is not None else []
        return configs[0].scheduler if len(configs) == 1 else None
    return scheduler


def _detached(loss, pl_module) -> float | None:
    """The value of a training loss that holds no autograd graph while the module trains (its
    backward will fail), else None: read only then, so no other step pays a host read."""
    if not isinstance(loss, torch.Tensor) or loss.requires_grad or not torch.is_grad_enabled() \
            or not any(p.requires_grad for p in pl_module.parameters()):
        return None
    return float(loss.detach().float().mean())


def _detached_note(step: int, value: float) -> str:
    """Why backward found no graph when every value the recorder saw was finite."""
    return (f"nanreplay: the loss the training_step returned at step {step} ({value:.3g}) "
            "holds no autograd graph, and every value the recorder saw was finite, so no "
            "bundle was written. A loss that puts a constant in place of a non-finite value "
            "does this (pytorch-forecasting's metrics, warning 'Loss is not finite. Resetting "
            "it to 1e9'): the NaN/Inf was made inside the loss's own computation, which no "
            "hook sees. Turn that warning into an error (warnings.filterwarnings(\"error\", "
            "\"Loss is not finite\")) and the recorder writes the step's bundle where it is "
            "raised, for nanreplay to name the loss's op; else the loss was computed under "
            "torch.no_grad() or detached")


def _attribute(root, dotted: str, what: str):
    obj = root
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"FlightRecorderCallback: {what}={dotted!r}: "
                                 f"{type(root).__name__} has no attribute {dotted!r}; name the "
                                 "attribute that holds it (e.g. 'model')")
        obj = getattr(obj, part)
    return obj
