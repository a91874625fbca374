"""The line that called the origin's module, when the step calls that module from more than one
line: one encoder for the queries and the passages, one time encoder for three inputs, a weight-
tied layer applied twice. "call 2" alone leaves the user to count the module's calls in the
forward; the caller's line says which one it was. (A module called again and again from one
line, a loop over time steps, gains nothing from it: its call number says which.) And, where
the op's own line is an installed package's (Pyro's ``kl.py``, a GPyTorch kernel), the line of
the model's or loss's code that called into that package."""

from __future__ import annotations

from typing import Any

from recorder.scripted import scripted_in

from .hits import OpHit, hit_sources
from .run_result import Run


def note_called_at(report: dict[str, Any], model, run: Run, origin: dict[str, Any],
                   hit: OpHit | None = None) -> None:
    """Set ``origin["called_at"]`` (``file:line``) for a forward origin's module call, and
    ``origin["called_from"]`` where the op's line is an installed package's (``hit_sources``);
    say so where the module holds TorchScript modules, whose ops are named at its call."""
    _note_scripted(report, model, origin.get("module"))
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


def _note_scripted(report: dict[str, Any], model, module: str | None) -> None:
    if module is None or not (inside := scripted_in(model, module)):
        return
    names = ", ".join(f"'{n}'" for n in inside[:3]) + (f" (+{len(inside) - 3})" if len(inside) > 3 else "")
    report["problems"].append(
        f"'{module or '<root>'}' holds TorchScript module(s) {names}, which run unhooked "
        "(PyTorch allows no hooks on a ScriptModule): an op inside one is named at the call "
        f"of '{module or '<root>'}' and the line that called it; to see its own module and "
        "line, replay with the eager module in the factory")
