"""The line that called the origin's module, when the step calls that module from more than one
line: one encoder for the queries and the passages, one time encoder for three inputs, a weight-
tied layer applied twice. "call 2" alone leaves the user to count the module's calls in the
forward; the caller's line says which one it was. (A module called again and again from one
line, a loop over time steps, gains nothing from it: its call number says which.) And, where
the op's own line is an installed package's (Pyro's ``kl.py``, a GPyTorch kernel), the line of
the model's or loss's code that called into that package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from recorder.scripted import hook_scripted, scripted_in

from .hits import OpHit, hit_sources
from .run_result import Run


def note_called_at(report: dict[str, Any], model, run: Run, origin: dict[str, Any],
                   hit: OpHit | None = None, scripted: Sequence[tuple] = ()) -> None:
    """Set ``origin["called_at"]`` (``file:line``) for a forward origin's module call, and
    ``origin["called_from"]`` where the op's line is an installed package's (``hit_sources``);
    say so where the module holds TorchScript modules, whose ops are named at its call, and
    name the one that ran the op (``scripted``: their calls as ``track_scripted`` keeps them)."""
    _note_scripted(report, model, origin, hit, scripted)
    if hit is not None and hit.source == origin.get("source"):
        origin.update(hit_sources(hit))
    mod, call, mb = origin.get("module"), origin.get("call"), origin.get("micro_batch") or 0
    if mod is None or call is None:
        return
    calls = [c for c in run.calls if c.module == mod and c.micro_batch == mb
             and not c.in_backward]
    if len({c.called_at for c in calls}) < 2:
        return
    hit = next((c for c in calls if c.call == call), None)
    if hit is not None and hit.called_at is not None:
        origin["called_at"] = hit.called_at


def track_scripted(finder, target, prefix: str, watching: Callable[[], bool]) -> list:
    """Hooks appending each call of ``target``'s outermost TorchScript modules to
    ``finder.scripted`` as (name, call, seq of its first op, seq after its last), while
    ``watching()``: the span of the op finder's op count an op inside one falls in."""
    open_at: list[tuple[str, int, int]] = []
    seen: dict[str, int] = {}

    def enter(name: str, *_) -> None:
        if watching():
            seen[name] = seen.get(name, 0) + 1
            open_at.append((name, seen[name] - 1, finder.seen))

    def leave(name: str, *_) -> None:
        if watching() and open_at:
            finder.scripted.append((*open_at.pop(), finder.seen))
    return hook_scripted(target, prefix, enter, leave)


def _note_scripted(report: dict[str, Any], model, origin: dict[str, Any], hit: OpHit | None,
                   scripted: Sequence[tuple]) -> None:
    module = origin.get("module")
    if module is None or not (inside := scripted_in(model, module)):
        return
    at = module or "<root>"
    ran = next((s for s in scripted if hit is not None and s[2] <= hit.seq < s[3]), None)
    if ran is not None:  # (the op's count fell inside that module's call)
        origin["scripted"], origin["scripted_call"] = ran[0], ran[1]
        report["problems"].append(
            f"{hit.op} ran inside '{ran[0]}' (call {ran[1]}), a TorchScript module, which runs "
            "unhooked (PyTorch allows no hooks on a ScriptModule): its values are checked at "
            f"the call of '{at}' that ran it, and the line given is the one that called "
            f"'{ran[0]}'; to see the op's own line, replay with the eager module in the factory")
        return
    names = ", ".join(f"'{n}'" for n in inside[:3]) + (f" (+{len(inside) - 3})" if len(inside) > 3 else "")
    report["problems"].append(
        f"'{at}' holds TorchScript module(s) {names}, which run unhooked "
        "(PyTorch allows no hooks on a ScriptModule): an op inside one is named at the call "
        f"of '{at}' and the line that called it; to see its own module and "
        "line, replay with the eager module in the factory")
