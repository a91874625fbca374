"""A training framework's method run under a callback's recorder's exception check.

Keras, Poutyne, skorch and stable-baselines3 call no callback when their loop raises, so a
callback that attaches when training begins would leave its hooks on the model and bundle
nothing for an exception other than the recorder's own (the model's own NaN check, a loss's
refusal). Their callbacks wrap the loop's method with :func:`checked`: the step the exception
cut short is checked and bundled, the exception goes on with the recorder's summary as a note,
and the callback detaches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def checked(callback, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` under ``callback.recorder``'s exception check (an ``Exception``, not a
    ``KeyboardInterrupt``, which the frameworks end their loops on cleanly), then
    ``callback.detach()`` before the exception goes on."""

    def checked_run(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except Exception as e:
            if callback.recorder is not None:  # the step it cut short: checked, bundled
                callback.recorder.cycle.check_on_exception(e)
            callback.detach()
            raise

    return checked_run
