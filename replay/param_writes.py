"""Frozen parameters made non-finite outside the optimizer: by the step's own forward, before
they were used, or by the loop's own EMA update between steps.

MoCo v3 passes its momentum to the forward (``model(x1, x2, m)``), which updates the momentum
encoder first (``param_m.data = param_m.data * m + param_b.data * (1 - m)``). A momentum of
NaN (a cosine schedule over 0 epochs) makes those parameters NaN in that step's forward; the
recorder then finds them non-finite, the last update having left them finite, and the bundle
holds them as the forward left them. Such parameters were not non-finite when the step
began: with them made finite again, the re-run's forward writes a non-finite value into them
once more, and the op that made it (and a non-finite number passed to the forward, which the
recorder checks no more than any other non-tensor argument) says where it came from. One
forward more, only for a weights origin whose bad parameters are frozen.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.capture import batch_path
from recorder.finite import finite, kind_of

from .errors import ReplayError
from .load import Step, micro_batch_inputs
from .ops import OpFinder
from .rerun import Runner


def forward_made(step: Step, bad: list[str]) -> dict[str, Any] | None:
    """For the frozen parameters among ``bad``: ``{"params", "kind", "op", "source",
    "numbers"}`` when the re-run's forward, started with them made finite, writes a non-finite
    value into them again (``numbers``: the paths of non-finite numbers among the step's
    forward arguments); None otherwise."""
    if step.model is None or step.stripped:
        return None
    params = dict(step.model.named_parameters())
    watched = {n: params[n] for n in bad if n in params and not params[n].requires_grad}
    if not watched:
        return None
    kept = {n: p.data for n, p in watched.items()}
    finder, runner = OpFinder(), None
    try:
        with torch.no_grad():
            for p in watched.values():
                p.data = torch.nan_to_num(p.data, nan=0.0, posinf=0.0, neginf=0.0)
        runner = Runner(step)
        runner.run(backward=False, instrument=False, forward_ctx=lambda: finder)
        again = [n for n, p in watched.items() if not finite(p)]
        kind = kind_of(params[again[0]]) if again else None
    except Exception:  # the weights origin stands without this evidence
        return None
    finally:
        if runner is not None:  # the buffers and frozen parameters as the step began
            runner.reset()
        for n, p in watched.items():
            p.data = kept[n]
    if not again:
        return None
    hit = finder.origin()
    return {"params": again, "kind": kind, "op": hit.op if hit else None,
            "source": hit.source if hit else None, "numbers": non_finite_numbers(step)}


def non_finite_numbers(step: Step) -> dict[str, float]:
    """The NaN/Inf Python numbers among the forward arguments of the step's micro-batches,
    by path (``args[2]``)."""
    found: dict[str, float] = {}

    def walk(o: Any, raw: str, n_args: int) -> None:
        if isinstance(o, float) and not math.isfinite(o):
            found.setdefault(batch_path(raw, n_args), o)
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{raw}[{i}]", n_args)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f'{raw}["{k}"]' if isinstance(k, str) else f"{raw}[{k}]", n_args)

    for i in range(len(step.micro_batches)):
        args, kwargs = micro_batch_inputs(step, i)
        walk([list(args), kwargs], "", len(args))
    return found


def number_note(step: Step, report: dict[str, Any]) -> str | None:
    """A note naming a NaN/Inf number the step passed to the forward (DANN's GRL coefficient
    from a schedule's 0/0) when the hint does not already: a number is not checked as data,
    so the origin is the op that first used it, not the input."""
    try:
        numbers = list(non_finite_numbers(step).items()) if step.micro_batches else []
    except (ReplayError, ValueError, KeyError):  # (a batch it cannot rebuild, or stripped)
        return None
    if not numbers or any(k in (report.get("hint") or "") for k, _ in numbers):
        return None
    (path, v), more = numbers[0], len(numbers) - 1
    return (f"the forward was passed the number {path} = {v}" + (f" (+{more} more)" if more
            else "") + ", a number, not a tensor, so not checked as data: "
            + _fix_number("progress"))


def _fix_number(schedule: str) -> str:
    """What to do about a non-finite number the loop passed to the forward."""
    return (f"fix the code that computes it (a schedule's 0/0, such as a {schedule} over 0 "
            "total steps) or check it with math.isfinite before the forward")


def forward_made_hint(step: Step, made: dict[str, Any]) -> str:
    """What the report says of parameters the step's own forward made non-finite."""
    names = made["params"]
    more = f" (+{len(names) - 2} more)" if len(names) > 2 else ""
    at = f" ({made['op']} at {made['source'] or 'an unknown line'})" if made["op"] else ""
    numbers = list(made["numbers"].items())
    head = (f"{', '.join(names[:2])}{more} do not train and were not non-finite when step "
            f"{step.event.get('step')} began: the model's own forward writes them, and with "
            f"them made finite the re-run's forward writes {made['kind']} into them again{at}")
    if numbers:
        return (f"{head}, from the number {numbers[0][0]} = {numbers[0][1]} passed to "
                "forward (a number, not a tensor, so not checked as data): "
                + _fix_number("momentum"))
    return (f"{head}: that code made the value from finite ones in this step; guard the op "
            "it names (and the numbers it multiplies by)")


def loop_written_hint(step: Step, bad: list[str]) -> str | None:
    """The hint for bad parameters that the recorded optimizer does not hold: frozen ones
    (BYOL's target network, a DINO teacher inside the recorded model), which no update wrote,
    the loop's own EMA update did, between steps; trained ones (deep mutual learning's second
    network), which another optimizer stepped after the recorded one. None for any other."""
    opt = step.meta.get("optimizer")
    if step.model is None or not opt:
        return None
    held = {n for g in opt.get("param_groups") or [] for n in g.get("params") or []}
    params = dict(step.model.named_parameters())
    if not all(n in params and n not in held for n in bad):
        return None
    names = f"{', '.join(bad[:2])}" + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    trained = {params[n].requires_grad for n in bad}
    if trained == {True}:
        return _other_optimizer_hint(step, names, opt)
    if trained != {False}:
        return None
    tensors = [t for n in bad if (t := step.tensors.get(f"weights/{n}")) is not None]
    every = all(not torch.isfinite(t).any() for t in tensors) and tensors
    if first_recorded(step):
        return (f"{names} require no gradient and the optimizer does not hold them (a frozen "
                "teacher or target network), and " + _CAME_IN)
    return (f"{names} require no gradient and the optimizer does not hold "
            "them (a momentum/EMA target or teacher network): no update wrote them, the loop's "
            "own update of them did, between steps (or a checkpoint load)"
            + (", and every element of them is non-finite, as a non-finite coefficient makes"
               if every else "")
            + ": check that update (t.mul_(m).add_(s, alpha=1 - m)) for a non-finite momentum "
            "m, from its schedule, or source weight s, guard it (math.isfinite(m)), and resume "
            "from a checkpoint before it")


# the end of a hint for parameters non-finite at the first step the recorder saw
_CAME_IN = ("they were non-finite at the first step the recorder saw: no update of the loop ran "
            "since it attached, so they came in so, from the checkpoint or state_dict they were "
            "loaded from (a corrupt teacher checkpoint) or code run before the recorder "
            "attached: check that file (torch.isfinite on each of its tensors) and load a "
            "finite one")


def _other_optimizer_hint(step: Step, names: str, opt: dict[str, Any]) -> str:
    """Trained parameters the recorded optimizer does not hold: another optimizer updates
    them, after the recorded one's ``step()`` closed the step (the order the guide asks for),
    so its update is checked only as the next step begins."""
    head = (f"{names} train (they require gradients) but the recorded optimizer "
            f"({opt.get('class') or 'given to the recorder'}) does not hold them, and ")
    if first_recorded(step):
        return head + _CAME_IN
    return (head + f"they were non-finite when step {step.event.get('step')} began: another "
            "optimizer's step() wrote them, after the recorded one had closed the step before "
            "(deep mutual learning's or a GAN's second network), or the loop's own update "
            "did: check that optimizer's hyper-parameters (a NaN/Inf learning rate from its "
            "schedule) and the gradients it used, and record that network's updates too (a "
            "FlightRecorder given that optimizer, or one optimizer over both networks)")


def first_recorded(step: Step) -> bool:
    """The event's step is the first the recorder saw (its ring buffer holds no step before
    it, nor did it ever drop one: it is not full), so no update of the loop ran under it."""
    at, ring = step.event.get("step"), step.meta.get("ring") or {}
    steps = step.tensors.get("ring/steps")
    if at is None or steps is None or not ring.get("stored", 0) < ring.get("history", 0):
        return False
    return not any(s < at for s in steps.tolist())


def built_non_finite_hint(step: Step, bad: list[str]) -> str | None:
    """The hint for bad parameters or buffers that the factory itself builds non-finite: no
    update and no write of the loop made them so, the model's own initialisation did (a CRF's
    forbidden transitions written into its trained ``transitions`` as -inf; a normaliser's
    ``mean`` buffer computed from data holding a log of a negative value). None for any
    other."""
    if not bad or step.rebuild is None or not first_recorded(step):
        return None
    try:  # (the replay's model was built on the meta device: build it again, for its values)
        model = step.rebuild()
        built = dict(model.named_parameters()) | dict(model.named_buffers())
    except Exception:  # the factory ran once already; this is only a better hint
        return None
    # (a meta tensor: the factory kept one from its call on the meta device, as a cache)
    if not all(n in built and not built[n].is_meta and not finite(built[n].detach())
               for n in bad):
        return None
    names = f"{', '.join(bad[:2])}" + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    buffers = set(step.meta.get("buffers") or ())
    if all(n in buffers for n in bad):
        return (f"the factory builds buffer {names} non-finite: the model starts so, no update "
                "or write of the loop made it. Fix the code that computes it when the model "
                "is built (statistics of the data: a log of a value <= 0, a 0/0 of a constant "
                "channel, a NaN record among those it averages)")
    return (f"the factory builds {names} non-finite: the model starts so, no update or write "
            "of the loop made them. An intended -inf (forbidden transitions, a mask) does not "
            "belong in a trained parameter, whose updates and norms it spoils: keep a boolean "
            "mask in a buffer and apply it in forward (w.masked_fill(~allowed, -inf), or a "
            "large finite negative such as -1e4); else fix the initialisation")
