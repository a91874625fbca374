"""A warning the run turned into an error, an error again in the re-runs
(``replay.load.run_switches`` enters it beside torch.distributions' ``validate_args``).

A library that warns where a value went non-finite and goes on (pytorch-forecasting's
``MultiHorizonMetric``: ``warnings.warn("Loss is not finite. Resetting it to 1e9")``, then a
constant loss that backward cannot differentiate) raises it in a run under
``warnings.filterwarnings("error", ...)`` or ``python -W error``: raised inside the loss, it
is the recorder's ``"check"`` event (:mod:`recorder.numeric_check`). ``nanreplay`` runs
without that filter, so the re-run would warn and go on past the raise the recorded step
ended at (the loss call then ran in the re-run but not in the recording: a fidelity
mismatch). The re-runs turn the recorded warning, by its class and message, into an error
again.
"""

from __future__ import annotations

import builtins
import contextlib
import re
import warnings
from typing import Any

# recorder.numeric_check.check_detail's text: "the step's code raised Class (message) at f:n"
_SAID = re.compile(r"the step's code raised (\w*Warning) \((.*)\) at \S+:\d+;")


@contextlib.contextmanager
def warning_as_error(event: dict[str, Any]):
    """The warning a ``"check"`` event was raised as, an error while the context is open;
    nothing for any other event."""
    said = _SAID.match(event.get("detail") or "") if event.get("reason") == "check" else None
    if said is None:
        yield
        return
    cls = getattr(builtins, said.group(1), None)  # (a library's own class: any Warning)
    cls = cls if isinstance(cls, type) and issubclass(cls, Warning) else Warning
    with warnings.catch_warnings():
        # (a prefix: the detail holds the message's first line, cut at 160 characters)
        warnings.filterwarnings("error", message=re.escape(said.group(2)), category=cls)
        yield
