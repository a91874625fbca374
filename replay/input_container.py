"""A forward event the recorder named at a call enclosing the origin, because the origin's
call returned the container it was given with its output written into it
(sentence-transformers' modules: ``features["sentence_embedding"] = ...; return features``;
SchNetPack's inputs dict). The recorder reads a call's inputs after the call returns, so it
saw that output among the call's inputs, took them as non-finite and went up to the first
call whose inputs it saw finite (the root, whose batch it copied as it was called). The
re-run watches each call's inputs before it runs, and names the op inside: the same event,
seen closer, not another one. A call that writes into the tensor it was given, in place (a
``mark_dirty`` autograd.Function, ``x.log1p_()`` on its argument), is seen the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IN_PLACE", "written_into_input"]

IN_PLACE = "tensor"  # a Call's returned_input: it wrote into an input tensor in place
RETURNED = "returns the {kind} it was given with its output written into it"
WRITTEN = "writes its output into the tensor it was given, in place"
NOTE = ("the recorder named {recorded}, a call enclosing '{module}': '{module}' {how}, and "
        "the recorder reads a call's inputs after it returns, so it saw that output among the "
        "inputs of '{module}' and "
        "named the first call whose inputs it saw finite; the re-run reads them before the call")


def written_into_input(step, call) -> str | None:
    """The note that explains a forward event's module as the enclosing call of the re-run's
    origin ``call`` (a :class:`~replay.run_result.Call`) that returned its input container or
    wrote into its input tensor; None when that is not the case."""
    ev: dict[str, Any] = step.event
    recorded = ev.get("module")
    if ev.get("phase") != "forward" or not isinstance(recorded, str) or call is None \
            or not getattr(call, "returned_input", None):
        return None
    module = call.module
    if module == recorded or not (recorded == "" or module.startswith(recorded + ".")):
        return None
    name = f"'{recorded}'" if recorded else "the root"
    kind = call.returned_input
    how = WRITTEN if kind == IN_PLACE else RETURNED.format(kind=kind)
    return NOTE.format(recorded=name, module=module, how=how)
