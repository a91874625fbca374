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

# what a check on a value's finiteness says, in its message or in the line that raised
_SPEAKS = re.compile(r"\b(nan|nans|inf|infs|infinite|infinity|non-?finite|not finite|finite|"
                     r"isnan|isinf|isfinite|isneginf|isposinf|underflow|overflow)\b", re.I)
# PyTorch's own kernels refusing a NaN (or a value outside their domain) in words of their own
_REFUSED = re.compile(r"normal expects all elements of std >= 0|all elements of input should be "
                      r"between 0 and 1|Expected p_in >= 0 && p_in <= 1|invalid Poisson rate")
_KINDS = (AssertionError, ValueError, RuntimeError, ArithmeticError)


def check_reason(exc: BaseException) -> str | None:
    """``"check"`` when ``exc`` reads as a check refusing a non-finite value."""
    if not isinstance(exc, _KINDS):
        return None
    said = str(exc)
    return "check" if _SPEAKS.search(said) or _REFUSED.search(said) \
        or _SPEAKS.search(raising_line(exc)) else None


def raising_line(exc: BaseException) -> str:
    """The source text of the line that raised ``exc`` (its innermost frame), or ''."""
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return _code(linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip())


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
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _AUTOGRAD in code.co_filename and code.co_name in ("_engine_run_backward", "backward",
                                                             "grad"):
            return True
        tb = tb.tb_next
    return False


def check_detail(exc: BaseException) -> str:
    """The event's detail: the error and the line that raised it."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else raising_line(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    at = f" at {tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else ""
    return (f"the step's code raised {type(exc).__name__} ({said[:160]}){at}; the step's "
            "statistics up to there were finite")
