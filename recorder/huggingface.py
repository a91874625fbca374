"""``transformers.Trainer`` integration: the flight recorder as a ``TrainerCallback``.

    from recorder.huggingface import FlightRecorderCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[FlightRecorderCallback(factory="mypkg.train:make_model")])
    trainer.train()     # raises NonFiniteError(bundle_path=...) at the first event

The Trainer builds its optimizer, scheduler and (for fp16) GradScaler inside ``train()``, so the
recorder is attached when training begins, with those (unwrapped from accelerate's wrappers),
and detached when it ends. The model computes its own loss (``labels`` in the batch), which the
recorder sees as part of the model's output; pass ``loss_fn=`` only for a loss module that a
custom ``compute_loss`` calls. Importing this module needs ``transformers``, and building the
callback ``accelerate`` (which the Trainer needs); nothing else in ``recorder`` does.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import TrainerCallback

from .flight import FlightRecorder
from .settings import check_callback_options


class FlightRecorderCallback(TrainerCallback):
    """Records every ``Trainer.train()`` step; ``options`` are :class:`FlightRecorder`'s
    keyword arguments (``out_dir``, ``factory``, ``on_event``, ``allow_inf``, ...), checked
    now. The optimizer, scheduler, GradScaler and the first step's index come from the
    Trainer. ``self.recorder`` is the recorder of the current (or last) ``train()``."""

    def __init__(self, **options: Any):
        _require_accelerate()
        check_callback_options(options.get("loss_fn"), options)
        self.options = options
        self.recorder: FlightRecorder | None = None
        self._raised = None  # the hook that sees the model's forward raise

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        self.detach()  # a second train() on the same Trainer
        opt, scaler = _torch_optimizer(optimizer)
        sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper
        self.recorder = FlightRecorder(model, opt, scaler=scaler, lr_scheduler=sched,
                                       start_step=state.global_step, **self.options)
        # torch_compile=True: accelerate compiled the model into a wrapper callbacks do not see,
        # so the model is one compiled region with hooks dynamo leaves out (recorder.compiled)
        self.recorder.target.compiled_elsewhere = bool(getattr(args, "torch_compile", False))
        self.recorder.integration = "huggingface"
        self.recorder.attach()
        # the Trainer tells no callback of an exception: the model's own NaN check raising in
        # its forward (which computes the loss) is seen here, as a ``with`` block's exit would
        self._raised = model.register_forward_hook(self._forward_raised, always_call=True)

    def _forward_raised(self, module, args, output) -> None:
        """The model's forward raised (``always_call``: output None, inside torch's handler):
        the step it cut short is checked, and a bundle written for a check that refused a
        non-finite value; the exception goes on with the recorder's summary as a note."""
        exc = sys.exc_info()[1] if output is None else None
        if exc is not None and self.recorder is not None:
            self.recorder.cycle.check_on_exception(exc)

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.end_step()  # forwards after the last update, if any
        self.detach()

    def detach(self) -> None:
        """Remove the recorder's hooks (done at the end of training; after a
        ``NonFiniteError`` they are inert until this is called)."""
        if self._raised is not None:
            self._raised.remove()
            self._raised = None
        if self.recorder is not None:
            self.recorder.detach()


def _require_accelerate() -> None:
    """The Trainer runs its loop through ``accelerate`` (and hands callbacks its wrappers):
    without it, say so now rather than fail inside ``train()``."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ImportError("FlightRecorderCallback: the Hugging Face Trainer integration needs "
                          "the 'accelerate' package (transformers.Trainer runs its training "
                          "loop through it); install it: pip install accelerate") from None


def _torch_optimizer(optimizer) -> tuple[torch.optim.Optimizer | None, Any]:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (whose ``step`` calls
    it, so the recorder's hooks go there), and the GradScaler that wrapper holds for fp16."""
    scaler = None
    while optimizer is not None and isinstance(getattr(optimizer, "optimizer", None),
                                               torch.optim.Optimizer):
        scaler = scaler or getattr(optimizer, "scaler", None)
        optimizer = optimizer.optimizer
    return optimizer, scaler
