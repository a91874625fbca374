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
from recorder.wrapped import is_wrapper

from .built_by import FirstMade, built_by_text
from .errors import ReplayError
from .grown_weights import grown_rule_hint
from .half_cast import half_cast_text
from .load import Step, micro_batch_inputs
from .ops import OpFinder
from .partial_params import partial_hint
from .quantized_frozen import quantized_frozen_hint
from .rerun import Runner
from .uninitialised import built_hint
from .unit_rows import unit_rows_text
from .unmeasured_weights import unseen_grads_text, update_grad_norm
from .user_grad_hooks import in_backward, updated_in_backward
from .wrapped_load import finite_parts


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
    parts = {n: finite_parts(p) for n, p in watched.items() if is_wrapper(p)}  # (QLoRA's int8)
    finder, runner = OpFinder(), None
    try:
        with torch.no_grad():
            for p in (p for n, p in watched.items() if n not in parts):
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
            if n not in parts:
                p.data = kept[n]
        with torch.no_grad():
            for q, first in (x for saved in parts.values() for x in saved):
                q.copy_(first)
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
    (BYOL's target network, a DINO teacher inside the recorded model, or an EMA teacher
    recorded on its own, with no optimizer), which no update wrote, the loop's own EMA update
    did, between steps; trained ones (deep mutual learning's second network), which another
    optimizer stepped after the recorded one; and those it holds (``_held_written_hint``).
    None for any other."""
    opt = step.meta.get("optimizer")
    held = {n for g in (opt or {}).get("param_groups") or [] for n in g.get("params") or []}
    frozen = set(step.meta.get("frozen") or ())  # (as the step ran; the factory may train them)
    names = f"{', '.join(bad[:2])}" + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    if step.model is None:  # (no factory: the bundle's names and flags, frozen ones only)
        recorded = set(step.meta.get("params") or ())
        if not all(n in recorded and n in frozen and n not in held for n in bad):
            return None
        return _frozen_hint(step, bad, names, "the optimizer does not hold them" if opt else
                            "the recorder was given no optimizer")
    params, buffers = dict(step.model.named_parameters()), dict(step.model.named_buffers())
    if any(n in params for n in bad) and all(n in params or n in buffers for n in bad):
        bad = [n for n in bad if n in params]  # (a state_dict load writes buffers beside them)
        names = f"{', '.join(bad[:2])}" + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    if not all(n in params for n in bad):
        return None
    trained = {params[n].requires_grad and n not in frozen for n in bad}
    if opt and trained == {True} and all(n in held for n in bad):
        return _held_written_hint(step, bad, names)
    if any(n in held for n in bad):
        return None
    if trained == {True}:
        return _other_optimizer_hint(step, names, opt) if opt else None
    if trained != {False}:  # (both: DreamerV3's critic, by its own Adam, and its EMA target)
        return _mixed_hint(step, bad, params, frozen, opt) if opt else None
    return _frozen_hint(step, bad, names, "the optimizer does not hold them" if opt else
                        "the recorder was given no optimizer")


def _mixed_hint(step: Step, bad: list[str], params: dict, frozen: set, opt: dict) -> str:
    """Trained and frozen parameters, none of them the recorded optimizer's: each kind's
    hint, the frozen ones' EMA having most likely copied the trained ones' values."""
    kinds = ([n for n in bad if params[n].requires_grad and n not in frozen],
             [n for n in bad if not params[n].requires_grad or n in frozen])
    trained, still = (f"{', '.join(k[:2])}" + (f" (+{len(k) - 2} more)" if len(k) > 2 else "")
                      for k in kinds)
    return (_other_optimizer_hint(step, trained, opt) + ". And "
            + _frozen_hint(step, kinds[1], still, "the optimizer does not hold them"))


def _frozen_hint(step: Step, bad: list[str], names: str, held: str) -> str:
    """Frozen parameters non-finite as the step began: the loop's EMA update wrote them."""
    quantized = quantized_frozen_hint(step, bad, names, held, first_recorded(step))
    if quantized is not None:  # (QLoRA's int8 base weight: nothing updates it)
        return quantized
    tensors = [t for n in bad if (t := step.tensors.get(f"weights/{n}")) is not None]
    every = all(not torch.isfinite(t).any() for t in tensors) and tensors
    # (some only in whole slices: an element-wise division, a multiplicative update's 0/0)
    partial = "" if every else partial_hint(
        {n: t for n in bad if (t := step.tensors.get(f"weights/{n}")) is not None})
    if first_recorded(step):
        return (f"{names} require no gradient and {held} (a frozen teacher or target "
                "network), and " + _CAME_IN)
    return (f"{names} require no gradient and {held} (a momentum/EMA target or teacher "
            "network): no update wrote them, the loop's own update of them did, between steps "
            "(or a checkpoint load)"
            + (", and every element of them is non-finite, as a non-finite coefficient makes"
               if every else "")
            + partial + ("; else check" if partial else ": check")
            + " that update (t.mul_(m).add_(s, alpha=1 - m), torch._foreach_lerp_(t, s, "
            "1 - m)) for a non-finite momentum m, from its schedule, or source weight s, guard "
            "it (math.isfinite(m)), and resume from a checkpoint before it"
            + (grown_rule_hint(step, bad) or ""))


# where an intended -inf in a trained parameter belongs
_NO_MASK = ("An intended -inf (forbidden transitions, a mask) does not belong in a trained "
            "parameter, whose updates and norms it spoils: keep a boolean mask in a buffer and "
            "apply it in forward (w.masked_fill(~allowed, -inf), or a large finite negative "
            "such as -1e4)")

# the end of a hint for parameters non-finite at the first step the recorder saw
_CAME_IN = ("they were non-finite at the first step the recorder saw: no update of the loop ran "
            "since it attached, so they came in so, from the checkpoint or state_dict they were "
            "loaded from (a corrupt teacher checkpoint) or code run before the recorder "
            "attached: check that file (torch.isfinite on each of its tensors) and load a "
            "finite one")


def _held_written_hint(step: Step, bad: list[str], names: str) -> str | None:
    """Trained parameters the recorded optimizer holds, non-finite as the step began: its
    every update was checked, so the loop wrote them since the last one (a federated round's
    aggregate loaded into the model, a soup or merge, an average copied in) or they came in
    so. How much of them is non-finite tells a bad coefficient from an element-wise one."""
    at, last = step.event.get("step"), step.event.get("last_update_step")
    spread = _spread(step, bad)
    one = len(bad) == 1
    them, they, head = ("it", "it was", f"{names} trains") if one else \
        ("them", "they were", f"{names} train")
    if first_recorded(step) and _only_minus_inf(step, bad):
        return (f"{head} and the recorded optimizer holds {them}, and {they} -inf, and only "
                "-inf, at the first step the recorder saw: no update ran since it attached, "
                "so the code before it wrote that mask value in (forbidden transitions of a "
                "CRF set with transitions.data[~allowed] = -inf, a constraint). " + _NO_MASK)
    if first_recorded(step):
        return (f"{head} and the recorded optimizer holds {them}, and {they} "
                "non-finite at the first step the recorder saw: no update ran since it "
                f"attached, so {they.split()[0]} came in so, with the state_dict loaded before (a checkpoint, "
                "or weights computed by hand: a model soup, a task-arithmetic or TIES merge, a "
                "federated aggregate, or a data-dependent init from the first batches: a "
                "decoder bias set to their geometric median or mean, k-means centroids, of an "
                "empty or constant batch)" + (f"; {spread}" if spread else "") + ". Check each "
                "tensor where it is made or loaded (torch.isfinite(t).all()) and load finite "
                "ones")
    if last is None:
        return None
    return (f"{head} and the recorded optimizer holds {them}, and its update of step "
            f"{last} left {them} finite: the loop wrote {them} between that update and step {at} "
            "(weights it computed and loaded with load_state_dict or copy_: a federated "
            "round's average of the clients' state_dicts, a model soup or task-arithmetic "
            "merge, an EMA or SWA average copied in, k-means centroids set as a layer's "
            "cluster centres or prototypes, a checkpoint loaded mid-run: a rollback or "
            "resume with accelerator.load_state, fabric.load or load_state_dict; or an "
            "in-place edit: "
            "connections pruned or "
            "regrown, dead units re-initialised, with a std or norm over one value or none, "
            "NaN)"
            + (f"; {spread}" if spread else "") + ". Check that code, and each tensor it "
            "loads (torch.isfinite(t).all()) before loading it; skip a non-finite "
            "contribution, and resume from a checkpoint before it")


def _only_minus_inf(step: Step, bad: list[str]) -> bool:
    """Every non-finite entry of the bundle's ``bad`` weights is -inf: a mask's value."""
    kept = [step.tensors.get(f"weights/{n}") for n in bad]
    return all(t is not None and kind_of(t.detach()) == "-inf" for t in kept)


def _spread(step: Step, bad: list[str]) -> str | None:
    """Whether the bad parameters are non-finite throughout (a non-finite coefficient or
    divisor, or a contribution non-finite throughout) or only in some elements."""
    tensors = {n: t for n in bad if (t := step.tensors.get(f"weights/{n}")) is not None}
    if not tensors:
        return None
    if all(not torch.isfinite(t).any() for t in tensors.values()):
        return (f"every element of {'it' if len(bad) == 1 else 'them'} is non-finite, as a "
                "non-finite coefficient or divisor "
                "makes (a client weight n_k / sum(n) over no samples, 0/0; an update divided "
                "by a count of local steps or a norm that is 0) or a contribution non-finite "
                "throughout (a diverged client's weights)")
    name, t = next(iter(tensors.items()))
    if (cast := half_cast_text(name, t)) is not None:  # (a float16 checkpoint's overflow)
        return cast
    n_bad = int((~torch.isfinite(t)).sum())
    rows = unit_rows_text(name, t)
    if whole_rows(t):
        return (f"whole rows of {name} are non-finite and its other rows finite throughout, "
                "as a write row by row makes: a row divided by a count or norm of 0 (an "
                "empty cluster's centroid sum / count: clamp the count to at least 1, or keep "
                "the old centroid; a zero row normalised), a row re-initialised from NaN, or a "
                "checkpoint file holding those rows non-finite (a corrupt or partly written "
                "save, loaded with load_state_dict, accelerator.load_state or fabric.load: "
                "check the "
                "file's tensors before loading it)" + (f"; {rows}" if rows else ""))
    return (f"only some elements are non-finite ({n_bad} of {t.numel()} in {name}), as an "
            "element-wise division makes where its divisor is 0 there (a mean over the "
            "contributions a mask kept, such as TIES-merging's disjoint mean, or an empty "
            "cluster's centroid sum / count, where none did: clamp the count to at least 1, "
            "or keep the old centroid) or a contribution non-finite in those elements"
            + (f"; {rows}" if rows else ""))


def whole_rows(t: torch.Tensor) -> bool:
    """Whether ``t``'s non-finite elements fill whole rows (along dim 0) and leave the other
    rows finite, at least one row finite (a tensor non-finite throughout is no row write)."""
    if t.dim() < 2:
        return False
    bad = ~torch.isfinite(t.flatten(1))
    return bool((bad.all(1) == bad.any(1)).all()) and not bool(bad.all())


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
            "schedule, Adam's eps=0 where a gradient was all 0) and the gradients it used, and record that network's updates too (a "
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
    if not bad or step.rebuild is None:
        return None
    first = first_recorded(step)
    if not first and not _frozen_throughout(step, bad):
        return None
    made = FirstMade()  # (the factory's op that made the value, when one did)
    try:  # (the replay's model was built on the meta device: build it again, for its values)
        with made:
            model = step.rebuild()
        built = dict(model.named_parameters()) | dict(model.named_buffers())
    except Exception:  # the factory ran once already; this is only a better hint
        return None
    # (a meta tensor: the factory kept one from its call on the meta device, as a cache)
    if not all(n in built and not built[n].is_meta for n in bad):
        return None
    if not first and not all(_same_non_finite(built[n], step.tensors.get(f"weights/{n}"))
                             for n in bad):
        return None  # (later than the first step: only the very entries the factory builds)
    names = f"{', '.join(bad[:2])}" + (f" (+{len(bad) - 2} more)" if len(bad) > 2 else "")
    buffers = set(step.meta.get("buffers") or ())
    if all(n in buffers and finite(built[n].detach()) for n in bad):
        # (a buffer no update writes: the loop set it so, or the run's arguments did)
        return default_args_hint(names) if step.default_args else set_before_hint(names)
    if not all(not finite(built[n].detach()) and _covers(step, n, built[n]) for n in bad):
        return None  # (finite where the bundle's is not: a -inf mask, not to_empty's NaN)
    kinds = {kind_of(built[n]) for n in bad}
    if made.found is None and (text := built_hint(made.unwritten, [built[n] for n in bad],
                                                  names)) is not None:
        return text  # (torch.empty never written in full, no op's NaN: replay.uninitialised)
    if all(n in buffers for n in bad):  # (the op and line that made it, where one did)
        return built_by_text(made.first_of(kinds), f"buffer {names}", kinds) or (
            f"the factory builds buffer {names} non-finite: the model starts so, no update "
            "or write of the loop made it. Fix the code that computes it when the model is "
            "built (statistics of the data: a log of a value <= 0, a 0/0 of a constant "
            "channel, a NaN record among those it averages)")
    if (text := built_by_text(made.first_of(kinds), names, kinds)) is not None:
        return text
    if kinds == {"nan"}:  # (no -inf: nothing a mask would write)
        return (f"the factory builds {names} NaN: the model starts so, no update or write of "
                "the loop made them, and NaN is no mask value: the values it starts from "
                "hold it (a checkpoint or pretrained state_dict the factory loads, saved "
                "after its own run had diverged; an initialisation given data holding NaN, "
                "or written by hand). Check torch.isfinite over what it loads, and load an "
                "earlier checkpoint or re-initialise those entries" + _read_late(step, first))
    return (f"the factory builds {names} non-finite: the model starts so, no update or write "
            f"of the loop made them. {_NO_MASK}; else fix the initialisation")


def _frozen_throughout(step: Step, bad: list[str]) -> bool:
    """Every parameter of ``bad`` was frozen as the step ran and the recorded optimizer holds
    none: nothing the recorder saw updates them, so entries the factory builds non-finite
    stayed so from the start, whatever step first read them (a frozen base model's corrupted
    embedding row, read only when a batch holds its token)."""
    frozen = set(step.meta.get("frozen") or ())
    opt = step.meta.get("optimizer") or {}
    held = {n for g in opt.get("param_groups") or [] for n in g.get("params") or []}
    return all(n in frozen and n not in held for n in bad)


def _same_non_finite(built: torch.Tensor, kept: torch.Tensor | None) -> bool:
    """The factory's tensor is non-finite exactly where the bundle's is."""
    if kept is None or kept.shape != built.shape:
        return False
    return bool(torch.equal(~torch.isfinite(built.detach().cpu()), ~torch.isfinite(kept.cpu())))


def _read_late(step: Step, first: bool) -> str:
    """Why a frozen parameter the model was built with non-finite ended a later step only."""
    if first:
        return ""
    return (f". They were so since the model was built; step {step.event.get('step')} is only "
            "the first whose forward read those entries (an embedding row read only by the "
            "batches holding its token id, a frozen weight no update checks)")


def _covers(step: Step, name: str, built: torch.Tensor) -> bool:
    """The factory's tensor is non-finite wherever the bundle's is (of the same shape)."""
    kept = step.tensors.get(f"weights/{name}", step.tensors.get(f"buffers/{name}"))
    if kept is None or kept.shape != built.shape:
        return True  # (nothing to compare: the factory's build is the evidence)
    return not bool((torch.isfinite(built.detach().cpu()) & ~torch.isfinite(kept.cpu())).any())


def default_args_hint(names: str) -> str:
    """Buffers the model's class, called with no arguments (no factory recorded), builds
    finite: the run's build may have passed others (``Transformer(rope_theta=0)``)."""
    return (f"buffer {names} was non-finite at the first step the recorder saw, before any "
            "update, but the model's class called with its default arguments (the bundle "
            "names no factory) builds it finite: the run built the model with other "
            "arguments that make it so (a RoPE table's theta of 0, a size of 0), or the loop "
            "wrote it after building the model. Replay with --factory MOD:FN building the "
            "model as the run did to tell which, and check it (torch.isfinite(t).all()) "
            "before training")


def set_before_hint(names: str) -> str:
    """Buffers the factory builds finite, non-finite at the first step the recorder saw: the
    loop computed them after building the model (Deep SVDD's centre ``c``, from an initial
    pass over a loader that yielded nothing: 0/0) or loaded them."""
    return (f"the factory builds buffer {names} finite, but it was non-finite at the first "
            "step the recorder saw, before any update: the loop wrote it after building the "
            "model (a value computed from the data and copied in, a centre or a statistic "
            "averaged over an empty loader: 0/0; or a state_dict loaded). Fix the code that "
            "computes it, and check it (torch.isfinite(t).all()) before training")


def own_update_hint(step: Step) -> str:
    """Weights non-finite at a step of a loop that gave the recorder no optimizer: the loop's
    own update (``p -= lr * p.grad``) or load (a federated server's ``load_state_dict`` of the
    clients' average) between the steps is what writes them, and the ring says whether there
    were gradients, and finite ones, for an update to use (then it is that update's doing:
    :func:`replay.unmeasured_weights.update_grad_norm`)."""
    at = step.event.get("step")
    norm = update_grad_norm(step)
    grads = f" from finite gradients (their norm was {norm:.3g})" if norm is not None else ""
    after = f"step {at - 1}" if norm is not None else "the step before"
    late = step.event.get("written_after_forward") or []
    if text := updated_in_backward(step, step.event.get("params") or []):
        return text  # (an optimizer per parameter, stepped by the script's hooks in backward)
    return (f"the weights were already non-finite when step {at} began, and the recorder was "
            f"given no optimizer: the loop's own update after {after} (p -= lr * p.grad) "
            f"wrote them{grads}, or weights it computed and loaded (load_state_dict "
            "of a federated average of the clients' weights, a merge), unless other code "
            "edited them; check its arithmetic (a learning rate, an average's weights), and "
            "give the recorder the optimizer (or call your update through one) so each update "
            "is checked" + unseen_grads_text(step)
            + (f". The step stayed open until the next forward, and the loop wrote "
               f"{len(late)} more parameter(s) after this step's forward read them finite: "
               "call rec.end_step() right after each step's forward and loss (an evaluation "
               "of the global model, before the next round writes it), so that each step is "
               "checked, and its bundle taken, before the loop writes the weights"
               if late else ""))


def by_update(step: Step, hint: str | None) -> bool:
    """An update wrote the weights: an optimizer stepped in backward's hooks, or the loop's own
    update of finite gradients (as :func:`own_update_hint` says), which is its optimizer."""
    if in_backward(hint):
        return True
    return not step.meta.get("optimizer") and update_grad_norm(step) is not None \
        and hint == own_update_hint(step)
