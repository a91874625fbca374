"""A step that a ``torch.distributions`` argument check ended: the ``"constraint"`` event.

``Normal(loc, scale)``, ``Categorical(logits=...)``, ``Beta(a, b)`` validate their parameters
(on by default) and raise ``ValueError: Expected parameter scale ... to satisfy the constraint
GreaterThan(lower_bound=0.0), but found invalid values`` on a NaN, or on a finite value outside
the constraint (a scale that ``softplus`` rounded to 0, a raw negative one). A torch loss's own
argument check does the same (``F.gaussian_nll_loss``: ``ValueError: var has negative
entry/entries``, a variance read off a linear head as is): ``LOSS_CHECKS``. Raised inside the
model's forward, the value was made by code no hook sees the output of (the root's own
lines), or is finite, so the step's statistics alone show nothing: :func:`constraint_reason`
forces the bundle of such a step, as :func:`~recorder.linalg.linalg_reason` does for a failed
decomposition, and the replay finds the op that made the value (:mod:`replay.refused`).
"""

from __future__ import annotations

import re

# torch.distributions.Distribution._validate_args / _validate_sample
_PARAMETER = re.compile(r"Expected parameter (?P<name>\w+) \(.*?\) of distribution "
                        r"(?P<dist>\w+)\(.*?\) to satisfy the constraint (?P<constraint>.*?), "
                        r"but found invalid values", re.S)
_SUPPORT = re.compile(r"Expected value argument \(.*?\) to be within the support "
                      r"\((?P<constraint>.*?)\) of the distribution (?P<dist>\w+)\(.*?\), "
                      r"but found invalid values", re.S)

# a torch loss's own check of an argument, raised as a bare ValueError (``nn.GaussianNLLLoss``
# given a raw linear output as its variance): (who, what, the constraint)
LOSS_CHECKS = {"var has negative entry/entries": (
    "torch.nn.functional.gaussian_nll_loss", "argument var", "var >= 0")}


def refuser(dist: str) -> str:
    """The refusing code's name: a distribution's class, or a loss function's whole name."""
    return dist if "." in dist else f"torch.distributions.{dist}"


def constraint_reason(exc: BaseException) -> str | None:
    """``"constraint"`` when ``exc`` is a distribution's check refusing a value."""
    return "constraint" if refusal(exc) is not None else None


def refusal(exc: BaseException) -> tuple[str, str, str] | None:
    """(distribution, what it refused: ``parameter scale`` or ``value``, the constraint)."""
    if not isinstance(exc, ValueError):
        return None
    text = str(exc)
    if m := _PARAMETER.search(text):
        return m["dist"], f"parameter {m['name']}", m["constraint"]
    if m := _SUPPORT.search(text):
        return m["dist"], "value", m["constraint"]
    return LOSS_CHECKS.get(text)


def constraint_detail(exc: BaseException) -> str:
    """The event's detail: which distribution refused what, and the constraint."""
    dist, what, constraint = refusal(exc) or ("a distribution", "a value", "its constraint")
    return (f"{refuser(dist)} refused its {what} (constraint {constraint}); the step's "
            "statistics up to there were finite")


def constraint_summary(event: dict, path) -> str:
    """The :class:`~recorder.NonFiniteError` message of a ``"constraint"`` event."""
    head = f"nanreplay: at step {event['step']}, {event.get('detail') or 'a distribution raised'}."
    if path is None:
        return head
    return (f"{head} Bundle: {path}; run `nanreplay {path}` to find the op that made the value "
            "and why.")
