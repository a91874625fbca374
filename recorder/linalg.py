"""A step that raised a failed decomposition (``torch.linalg.LinAlgError``): the ``"linalg"``
event.

``torch.linalg.cholesky`` of a kernel matrix that stopped being positive-definite, ``inv`` or
``solve`` of a singular matrix, ``eigh`` that did not converge: the op raises inside one
module's forward (or the loss) before any hook sees its output, and often from a matrix that
is finite, so the step's statistics alone show nothing. :func:`linalg_reason` forces the
bundle of such a step, as :func:`~recorder.anomaly.anomaly_reason` does for anomaly mode's
error; the exception itself goes on to the loop unchanged (with the summary as a note).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .tape import Tape

# torch 2.x raises LinAlgError for most failures; a few raise a plain RuntimeError named by
# the function (``torch.linalg.lu_factor: U[1,1] is zero``, ``torch.linalg.eig: input
# tensor should not contain infs or NaNs``). Its argument checks (a wrong dtype or shape)
# say other things: a bug in the code, not a matrix the step made
_MESSAGE = re.compile(r"^(torch\.)?linalg\.\w+: .*(is zero|singular|positive-definite|"
                      r"converge|infs or NaNs)")
# MKL's LAPACK checks a matrix for NaN/Inf and reports one as an illegal argument, which torch
# raises as an internal assert (``torch.linalg.lstsq: (Batch element 2): Argument 4 has illegal
# value``): torch checked shapes and dtypes before, so it is the values the step made
_ILLEGAL = re.compile(r"linalg\.\w+: (\(Batch element \d+\): )?Argument \d+ has illegal value")
# A library's own decomposition wrapper raises a RuntimeError subclass of its own after
# torch's ``cholesky_ex`` reported failure (linear_operator's ``psd_safe_cholesky``, under every
# GPyTorch model: ``NotPSDError: Matrix not positive definite after repeatedly adding jitter``,
# ``NanError: cholesky_cpu: 576 of 576 elements ... are NaN``)
_WRAPPED = re.compile(r"not positive[- ](semi[- ])?definite|^\w*cholesky\w*: .*\bNaN\b")


def linalg_reason(exc: BaseException) -> str | None:
    """``"linalg"`` when ``exc`` is a decomposition or inversion that failed."""
    if isinstance(exc, torch.linalg.LinAlgError):
        return "linalg"
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if _MESSAGE.match(text) or _ILLEGAL.search(text):
        return "linalg"
    return "linalg" if type(exc) is not RuntimeError and _WRAPPED.search(text) else None


def raised_inside(exc: BaseException, modules) -> bool:
    """Whether ``exc`` was raised inside a call of one of ``modules`` (the model's, the loss
    module) or of the recorder's wrapper of a plain loss function: a frame of its traceback is
    that module's call. The loop's own code (a metric after the step) is not the recorded
    step's, and the replay could not re-run it."""
    ids = {id(m) for m in modules if m is not None}
    tb = exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        obj = local.get("self")
        if isinstance(obj, nn.Module) and (id(obj) in ids or getattr(obj, "recorded_loss", 0)):
            return True
        if _function_backward(local):
            return True
        tb = tb.tb_next
    return False


def _function_backward(local: dict) -> bool:
    """A frame of the backward of a custom autograd Function the step's graph holds (OptNet's
    solve of the KKT system), which the engine runs outside any module call."""
    return isinstance(local.get("ctx"), torch.autograd.function.BackwardCFunction)


def linalg_detail(tape: Tape) -> str:
    """The detail of a step cut short by a failed decomposition (its statistics so far are
    finite): the error, as :func:`note_error` kept it; the replay finds the module and op."""
    error = tape.linalg_error or "a torch.linalg function raised"
    return f"{error}; the step's statistics up to there were finite"


def error_text(exc: BaseException) -> str:
    """The error's type and first line, for an event's detail."""
    text = str(exc).strip().splitlines()
    name = ("torch.linalg.LinAlgError" if isinstance(exc, torch.linalg.LinAlgError)
            else type(exc).__name__)
    if text and (illegal := _ILLEGAL.search(text[0])):  # (not the "internal assert" around it)
        text = [f"torch.{illegal.group(0)} (LAPACK's refusal of a NaN or Inf in the matrix)"]
    return f"{name}: {text[0].rstrip('.') if text else ''}".rstrip(": ")


def note_error(tape: Tape, exc: BaseException, loss: nn.Module | None = None) -> None:
    """Keep the error's type and first line on the tape, for the event's detail, and the
    phase it was raised in: a Function's backward, the loss (``loss``, or the recorder's
    wrapper of a plain loss function) or else the model's forward."""
    tape.linalg_error = error_text(exc)
    tape.linalg_phase, tb = "forward", exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if _function_backward(local):
            tape.linalg_phase = "backward"
            break
        obj = local.get("self")
        if isinstance(obj, nn.Module) and (obj is loss or getattr(obj, "recorded_loss", 0)):
            tape.linalg_phase = "loss"  # (a Function's backward further in still wins)
        tb = tb.tb_next


def linalg_summary(event: dict, path) -> str:
    """The :class:`~recorder.NonFiniteError` message of a ``"linalg"`` event."""
    update = event.get("phase") == "optimizer"  # (raised by the update: recorder.update_linalg)
    head = (f"nanreplay: a matrix decomposition failed{' inside optimizer.step()' * update} at "
            f"step {event['step']} ({event.get('detail') or 'torch.linalg raised'}).")
    if path is None:
        return head
    if update:
        return (f"{head} Bundle: {path}; run `nanreplay {path}` to re-run the update and find "
                "the parameter, the op and whether the matrix was non-finite or singular.")
    return (f"{head} Bundle: {path}; run `nanreplay {path}` to find the module, the op and "
            "whether the matrix was singular, positive-definite in float64 only, or non-finite.")
