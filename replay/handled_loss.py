"""A micro-batch whose loss or backward raised in training, where the loop caught the exception
and went on (``except (IndexError, ValueError, RuntimeError): optimizer.zero_grad(); continue``:
a target out of range for ``cross_entropy``, ``ctc_loss`` refusing an input length, a masked
loss refusing an empty mask, a custom ``autograd.Function`` refusing in its backward). Its
forward returned, so the recorder keeps it as a micro-batch of the step a later ``step()``
closed, but none of its gradient is in the update. Its re-run raises again; that is the loop's
handled exception, not the end of the step: the re-run goes on past it, as the loop did, to
the micro-batch the event is in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .errors import StopRun
from .run_result import Run
from .source import raised_by_model


def went_on_past(step: Any, i: int) -> bool:
    """Whether the recorded step went on past micro-batch ``i``: a later forward followed it
    in the step. What ``i``'s loss or backward raises again in the re-run raised in training
    too (else the re-run departs from the run, and nothing it finds is evidence), and the loop
    caught it there, since a forward came after it. (A backward that raised inside the model,
    past its output: a gradient the loop's ``zero_grad`` then dropped, which the next
    micro-batch's ``grads_dropped`` mark says.)"""
    return i < len(step.micro_batches) - 1


@contextlib.contextmanager
def handled_by_loop(runner: Any, i: int, run: Run, phase: str) -> Iterator[None]:
    """Run micro-batch ``i``'s ``phase`` (``"loss"``, ``"backward"``) of ``runner``'s step;
    what its own code raises there is kept in ``run.handled`` and passed over when the
    recorded step went on past it (:func:`went_on_past`), and, after the runner's first run,
    only where that run's raised one of its type (``runner.loop_handled``: a raise that a later run's
    watching mode caused is that run's failure, not the loop's). Anything else raises."""
    try:
        yield
    except StopRun:
        raise
    except Exception as e:
        seen = (phase, " ".join(f"{type(e).__name__}: {e}".split()))
        if not went_on_past(runner.step, i) or not raised_by_model(e) \
                or not _as_first(runner.loop_handled, i, seen):
            raise
        run.handled[i] = seen


def _as_first(first: dict | None, i: int, seen: tuple[str, str]) -> bool:
    """Whether the runner's first run (``first``: None while it runs) raised in micro-batch
    ``i``'s phase an exception of ``seen``'s type (not its text: a float64 re-run's differs)."""
    if first is None:
        return True
    phase, text = first.get(i, ("", ""))
    return phase == seen[0] and text.split(":")[0] == seen[1].split(":")[0]


def handled_notes(run: Run) -> list[str]:
    """The report's lines for the micro-batches :func:`handled_by_loop` passed over."""
    return [f"micro-batch {i}'s {phase} raised {what[:200].rstrip('.')} in the re-run, as it "
            "did in training, where the loop caught it and went on without its gradient: the "
            "re-run went on past it too" for i, (phase, what) in sorted(run.handled.items())]
