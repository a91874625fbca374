"""The two exceptions of the project, one for training-time events, one for bad bundles; and
how an exception of another kind is cut to one line, or given the recorder's summary."""

from __future__ import annotations

import logging


class NonFiniteError(RuntimeError):
    """Raised by the recorder on the first NaN/Inf event, after the bundle is written.

    ``bundle_path`` is the written bundle (``None`` when writing it failed; the write error is
    then the ``__cause__`` and ``write_error``). When out_dir refused it (disk full, a file in
    its place), the bundle goes to a new temporary directory: ``bundle_path`` is there and
    ``write_error`` is out_dir's error. ``event`` is the event as a JSON-able dict.
    """

    def __init__(self, message: str, *, bundle_path=None, event=None, write_error=None):
        super().__init__(message)
        self.bundle_path = bundle_path
        self.event = event or {}
        self.write_error = write_error


def add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` (Python 3.11+: the loop's exception goes on, with the recorder's
    summary under its traceback), else a warning in the log."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        logging.getLogger("nanreplay").warning(text)


def first_line(e: BaseException, limit: int) -> str:
    """An exception's message for a one-line log or hint: its first line, at most ``limit``
    characters (a dispatcher error lists every backend it knows after it, 50 lines)."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


class BundleError(ValueError):
    """A bundle that cannot be read: the message names the file, what is wrong and what to do."""
