"""A tensor the forward reads that it keeps outside the model: a module-level cache
(``_PE_CACHE[n]``), a ``functools.lru_cache``'d function's result, a global made before the
loop. No bundle holds it, so the replay builds its own; a copy the run had built otherwise (a
cache entry filled before the recorder attached that held NaN, one built in another dtype or
from other data) is what no re-run can make again, and re-runs that agree with each other but
not with the recording say only "state outside the model".

One more re-run of the forward under a dispatch mode names the first op, in the event's module
when one there does, that takes a tensor no op of that re-run made and that is none of the
model's or loss's own tensors (parameters, buffers, attributes) nor a module's inputs (the
batch). A cache filled by an earlier re-run is read, not made, in this one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .call_stack import call_stack_hooks
from .compat import TorchDispatchMode, tree_leaves
from .loss_state import loss_self_updates, note_loss_updates
from .source import user_source

# ops whose tensor input is a Python-made constant of the code's own (``torch.tensor(2.0)``,
# ``torch.from_numpy``): made again at each call, not kept between calls
_FRESH = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy", "aten.lift"})


class _Reads(TorchDispatchMode):
    """The ops of a forward that read a tensor kept outside (see the module's docstring)."""

    def __init__(self, known: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.known = known  # the step's own tensors and those its ops made
        self.modules: list[str] = []
        self.found: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if self.modules and name not in _FRESH and len(self.found) < 64:
            tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            for k, t in enumerate(tensors):
                if t not in self.known:
                    self.found.append({
                        "op": name, "module": self.modules[-1], "source": user_source(),
                        "input": k, "shape": list(t.shape),
                        "dtype": str(t.dtype).removeprefix("torch.")})
                    self.known[t] = True  # (named once: its first read)
                    break
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.known[t] = True
        return out


def _own_tensors(known: WeakIdKeyDictionary, modules) -> None:
    """Every tensor a module holds as a parameter, buffer or attribute: the factory's or the
    bundle's, which the replay set."""
    for m in modules:
        for v in [*m.parameters(recurse=False), *m.buffers(recurse=False),
                  *vars(m).values()]:
            if isinstance(v, torch.Tensor):
                known[v] = True


def kept_outside(runner, event_module: str | None) -> dict[str, Any] | None:
    """The first read of a tensor kept outside the model in one more re-run of ``runner``'s
    forward (in ``event_module`` when one there is), as ``{"op", "module", "source", "input",
    "shape", "dtype"}``; None when the forward reads none, or the re-run fails."""
    known = WeakIdKeyDictionary()
    loss = runner.step.loss_fn if isinstance(runner.step.loss_fn, nn.Module) else None
    trace = _Reads(known)

    def entered(args, kwargs) -> None:
        for t in tree_leaves((args, kwargs)):  # (the batch, or what the caller passed in)
            if isinstance(t, torch.Tensor):
                known[t] = True

    def hooks(model):
        _own_tensors(known, [*model.modules(), *(loss.modules() if loss is not None else ())])
        return call_stack_hooks(model, trace.modules, entered)

    try:
        runner.run(instrument=False, backward=False, hooks=hooks, forward_ctx=lambda: trace)
    except Exception:  # (a note: the report stands without it)
        return None
    inside = [f for f in trace.found if event_module is not None and _within(
        f["module"], event_module)]
    return (inside or trace.found or [None])[0]


def _within(name: str, event_module: str) -> bool:
    return not event_module or name == event_module or name.startswith(event_module + ".")


def kept_outside_note(found: dict[str, Any]) -> str:
    """``found`` (:func:`kept_outside`) as the report's note."""
    where = found["op"] + (f" at {found['source']}" if found.get("source") else "")
    return (f"{where} in {found['module'] or '<root>'} reads a tensor kept outside the model "
            f"(input {found['input']}, {found['dtype']} {found['shape']}): none of its "
            "parameters, buffers or attributes, nor made by an op of the step; the bundle does "
            "not hold it, so the re-runs used the one the replay built")


def kept_outside_hint(found: dict[str, Any]) -> str:
    """What to do about ``found``: the run's copy is the suspect, and how to make it one the
    bundle holds."""
    return (f"the re-runs agree with each other but not with the recording, and the step reads "
            f"a tensor kept outside the model at {found.get('source') or found['op']} (a "
            "module-level cache, a functools.lru_cache'd function's result, a global): the "
            "run's copy was built otherwise than the replay's (a cache entry filled before "
            "the recorder attached, holding NaN or made in another dtype or device, or from "
            "other data) and no bundle holds it; check that entry in the run (torch.isfinite, "
            "its dtype), and keep such a tensor on the model (self.register_buffer(name, t, "
            "persistent=False)), which the bundle records, or rebuild it at each call")


def note_outside_state(report: dict[str, Any], step, runner) -> None:
    """Into a not-reproduced ``report`` whose re-runs agree: the state outside what the bundle
    holds that the step reads, when found: for a forward event a tensor kept outside the model;
    else (or when it reads none) a loss updating its own attributes (``replay.loss_state``),
    which a forward event's origin does not depend on, so there a note only."""
    forward = step.event.get("phase") == "forward"
    if forward and (kept := kept_outside(runner, step.event.get("module"))) is not None:
        report["kept_outside"] = kept
        report["problems"].append(kept_outside_note(kept))
        report["hint"] = kept_outside_hint(kept)
    elif (moved := loss_self_updates(runner)) is not None:
        hint = report["hint"]
        note_loss_updates(report, moved)
        if forward:  # (the loss runs after the forward's origin: not what decided it)
            report["hint"] = hint
