"""State a loop sets on the model outside ``forward``, which the factory's model lacks.

pytorch-ntm calls ``net.init_sequence(batch_size)`` before each sequence: it sets the memory
(``self.memory = self.mem_bias.clone().repeat(...)``) and ``self.previous_state``, which each
``forward`` (one time step) reads; the PyTorch LSTM tutorial's loop sets ``model.hidden =
model.init_hidden()``. The bundle keeps parameters, buffers and number attributes, not such
state, so the rebuilt model still holds the ``None`` its ``__init__`` left and its forward
raises before any value goes non-finite, which the recorded step did not (it ran to its
event). The report keeps what the recorder saw and names the attribute, its statement and
the fix, instead of 'replay failed'.
"""

from __future__ import annotations

import re

from torch import nn

from .errors import one_line
from .source import raised_at, raised_by_model, statement

_SELF_ATTR = re.compile(r"\bself\.(\w+)")


def unset_state_or_raise(e: BaseException, model: nn.Module) -> str:
    """The hint when ``e``, raised by the model's code in a re-run, comes from a statement
    reading ``self.NAME`` where a module of ``model`` holds None under NAME; else ``e`` is
    raised again (the replay failed)."""
    hint = _unset_state_hint(e, model)
    if hint is None:
        raise e
    return hint


def _unset_state_hint(e: BaseException, model: nn.Module) -> str | None:
    # (an error of using None: "cannot unpack non-iterable NoneType object", "'NoneType'
    # object has no attribute ...", "must be Tensor, not NoneType")
    used_none = isinstance(e, (TypeError, AttributeError)) and "NoneType" in str(e)
    where = raised_at(e) if used_none and raised_by_model(e) else None
    if where is None:
        return None
    path, _, line = where.rpartition(":")
    text = statement(path, int(line)).strip() if line.isdigit() else ""
    named = set(_SELF_ATTR.findall(text))
    unset = [f"{name}.{k}" if name else k for name, m in model.named_modules()
             for k, v in vars(m).items() if v is None and k in named and not k.startswith("_")]
    if not unset:
        return None
    return (f"the re-run raised {type(e).__name__} ({one_line(e, 120)}) at {where} `{text}` "
            f"before any value went non-finite, which the recorded step did not: "
            f"{', '.join(unset)} is None in the model the factory builds, state the loop sets "
            "outside forward (in a method it calls before the step's first forward, as "
            "pytorch-ntm's init_sequence or an init_hidden), which the bundle does not keep; "
            "have the factory build the model in that state (call that method there), or pass "
            "the state to forward as an argument, which the recorder keeps; the origin above "
            "is what the recorder saw")
