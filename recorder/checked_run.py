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

_MISSING = object()  # (an attribute the instance did not hold itself)


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


class Wrappers:
    """Functions set on instances in place of their methods (a framework's loop methods under
    :func:`checked`), each undone at :meth:`undo`: the attribute the instance held itself
    before (Keras's ``train_function``) put back, else the class's method showing through
    again. Set in the instance's ``__dict__``, past a ``__setattr__`` that tracks attributes
    (Keras's layers)."""

    def __init__(self) -> None:
        self._held: list[tuple[Any, str, Any]] = []

    def wrap(self, obj, name: str, fn: Callable[..., Any]) -> None:
        """``fn`` as ``obj.name`` until :meth:`undo`."""
        own = vars(obj)
        self._held.append((obj, name, own.get(name, _MISSING)))
        own[name] = fn

    def check(self, callback, obj, name: str) -> None:
        """``obj.name`` run under ``callback``'s recorder's exception check (:func:`checked`)."""
        self.wrap(obj, name, checked(callback, getattr(obj, name)))

    def undo(self) -> None:
        """Every wrapper off, the last set first."""
        while self._held:
            obj, name, saved = self._held.pop()
            own = vars(obj)
            own.pop(name, None)
            if saved is not _MISSING:
                own[name] = saved
