"""The replay's one exception: something outside the bundle stops the replay (a factory that
does not import, weights that do not fit the model). The CLI prints it as one line, exit 2."""

from __future__ import annotations


class ReplayError(Exception):
    """Says what went wrong, why, and which option fixes it."""


class FactoryRefused(ReplayError):
    """The bundle's recorded factory is not trusted (not under the current directory): the
    replay reports what the ring buffer can tell and which option to pass."""


class StopRun(Exception):
    """Raised from a hook to end a re-run early: what it was run for is known."""


def one_line(e: Exception, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters (torch's dispatcher
    errors list every backend it knows, several kilobytes); ``--debug`` prints it whole."""
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."
