"""A step that a numeric check in the model's own code ended: the ``"check"`` event.

Code guards its values where they are made: ``if torch.isnan(w).any(): raise ValueError("NaN
in attention weights")`` in a module's forward, ``assert torch.isfinite(x).all()``, an ODE
solver's ``assert`` on a non-finite state or a step size that underflowed (torchdiffeq). The
module that raised never returned, so no hook saw the value and the step's statistics up to
there are finite: without more, the exception would end training with no bundle. PyTorch's
own kernels check too (``torch.multinomial`` of NaN probabilities, ``torch.normal`` of a NaN
std, ``torch.bernoulli``, ``torch.poisson``), some in words of their own (``_REFUSED``). Raised
inside a call of the model or the loss, an error whose message or raising line speaks of a
non-finite value forces the step's bundle, as a failed decomposition does
(:mod:`recorder.linalg`), and so does one a gradient's check raised in backward (a tensor hook
of the forward's); the replay finds the op or the node that made the value
(:mod:`replay.raised_check`).
"""

from __future__ import annotations

import io
import linecache
import os
import re
import tokenize
import traceback

from .errors import first_line

# what a check on a value's finiteness says, in its message or in the line that raised
_SPEAKS = re.compile(r"\b(nan|nans|inf|infs|infinite|infinity|non-?finite|not finite|finite|"
                     r"isnan|isinf|isfinite|isneginf|isposinf|underflow|overflow)\b", re.I)
# PyTorch's own kernels refusing a NaN (or a value outside their domain) in words of their own
_REFUSED = re.compile(r"normal expects all elements of std >= 0|all elements of input should be "
                      r"between 0 and 1|Expected p_in >= 0 && p_in <= 1|invalid Poisson rate")
_KINDS = (AssertionError, ValueError, RuntimeError, ArithmeticError, Warning)


def check_reason(exc: BaseException) -> str | None:
    """``"check"`` when ``exc`` reads as a check refusing a non-finite value."""
    if not isinstance(exc, _KINDS):
        return None
    said = str(exc)
    return "check" if _SPEAKS.search(said) or _REFUSED.search(said) \
        or _SPEAKS.search(raising_line(exc)) else None


def _raised_at(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of ``exc``'s traceback, None without one."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    return (frames[-1][0].f_code.co_filename, frames[-1][1]) if frames else None


def raising_line(exc: BaseException) -> str:
    """The source text of the line that raised ``exc`` (its innermost frame), or ''."""
    at = _raised_at(exc)
    return _code(linecache.getline(*at).strip()) if at else ""


def _code(line: str) -> str:
    """``line`` without its comment (a note that mentions NaN is no check)."""
    try:
        for t in tokenize.generate_tokens(io.StringIO(line).readline):
            if t.type == tokenize.COMMENT:
                return line[:t.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line


_AUTOGRAD = os.sep + os.path.join("torch", "autograd") + os.sep


def raised_in_backward(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a backward pass (a tensor hook's or a Function's check on
    a gradient, ``h.register_hook(check_finite)``): torch's autograd engine is on its
    traceback. The forward that registered the hook registers it again in the re-run."""
    return any(_AUTOGRAD in f.f_code.co_filename
               and f.f_code.co_name in ("_engine_run_backward", "backward", "grad")
               for f, _ in traceback.walk_tb(exc.__traceback__))


def check_detail(exc: BaseException) -> str:
    """The event's detail: the error and the line that raised it."""
    said = first_line(exc, 160) or raising_line(exc)[:160]
    at = _raised_at(exc)
    where = f" at {os.path.basename(at[0])}:{at[1]}" if at else ""
    return (f"the step's code raised {type(exc).__name__} ({said}){where}; the step's "
            "statistics up to there were finite")
