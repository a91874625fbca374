"""``nanreplay BUNDLE --try KEY=VALUE``: would this change have kept training finite?

>>> parse_try("lr=0.1x")                            # doctest: +SKIP
('lr=0.1x', Change(lr_factor=0.1))
>>> run_tries(step, report, ["eps=1e-8", "lr=0.1x"])  # doctest: +SKIP
[{'try': 'eps=1e-8', 'finite': True, 'inconclusive': False, 'event_step': None, ...}, ...]

Each try re-runs the bundle's window from its copy (``FlightRecorder(rewind=N)``), or, without
one, the recorded step, with one change (see :class:`replay.window.Change`), and says whether
a non-finite value still appears and where. ``lr``, ``eps``, ``wd`` and ``clip`` apply to every
update of the run, ``dtype`` to every step's compute (weights, optimizer state and inputs cast,
autocast off), ``drop`` to the batch of the event step (the step whose samples the report
names), ``step_sizes`` and ``etas`` (pairs: Rprop's bounds on its growing step size,
``replay.update_bound``) to every update. ``auto`` tries the remedies that fit the cause found
(:func:`auto_tries`). A try is ``inconclusive`` when the re-run without any change is finite
too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .cause_text import BELOW_FLOAT32, BEYOND_FLOAT64
from .decay_divergence import decay_tries
from .departure import tries_note
from .diverging import beyond_run_type, still_diverging
from .drop import compared_with, left_by, undroppable
from .errors import ReplayError, one_line
from .foreign_update import try_note
from .group_lr import (
    check_group,
    every_group_note,
    jumped_group,
    last_finite_lr,
    lr_before_jump,
    split_group,
)
from .half_update import TRY as HALF_UPDATE
from .late_window import late_window_note
from .load import Step, autocast_dtype
from .negative_lr import below_zero
from .optim import default_eps1, eps_lost, safe_eps, squared_eps_lost
from .other_makers import drop_with_others
from .outliers import out_of_scale
from .recorded import batch_size
from .update_bound import GROWING, bound_tries, lr_beyond_dtype, parse_pair, usable_lr
from .window import Change, Window, run_window, step_as_window, window_of
from .zero_rows import empty_micro_batch

KEYS = ("lr", "eps", "clip", "dtype", "drop", "wd", *GROWING)
EXAMPLES = {"lr": "1e-4 (or lr=0.1x)", "eps": "1e-8", "clip": "1.0", "dtype": "float32",
            "drop": "3,7", "wd": "0.01", "step_sizes": "1e-6,50", "etas": "0.5,1.2"}
# the note of every try on an optimizer event's bundle that holds the weights after the update
# and no window: nothing before the update to re-run it from
AFTER_UPDATE = ("the bundle holds the weights after the update, not those before it: record "
                "with FlightRecorder(..., guard_optimizer=True) or rewind=N to re-run it with a "
                "change")
# the note of an lr, eps, wd or clip try when no update runs before the event in the re-run
# (a forward, loss or backward event without a window): the only update is the one after it,
# so the event comes back whatever the change
NO_UPDATE_BEFORE = ("{key} changes the optimizer's updates, and the re-run has none before the "
                    "event (it happens before step {step}'s update): record with "
                    "FlightRecorder(..., rewind=N) to re-run the updates that led to it")
RECORDED_LOSS_INPUT = (
    "the re-run's loss took the recorded copy of a value the loop computed from the model "
    "output (code between the model and the loss, such as an average over a clip's views, is "
    "not re-run), which holds the recorded NaN/Inf whatever the change; pass the model output to loss_fn as it is and do that computation inside the loss")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class TryError(ValueError):
    """A ``--try`` that cannot be parsed; the message is the one-line error."""


def parse_try(text: str) -> tuple[str, Change | None]:
    """``(label, change)``; ``change`` is None for ``auto``."""
    text = text.strip()
    if text == "auto":
        return text, None
    key, eq, value = text.partition("=")
    try:  # (lr[G]=VALUE: parameter group G's rate alone)
        key, group = split_group(key.strip())
    except ValueError as e:
        raise TryError(f"--try {text!r}: {e}") from None
    value = value.strip()
    if key in KEYS and not value:  # (not "KEY one of lr, ...": the key is one of them)
        raise TryError(f"--try {text!r}: {key} needs a value: --try {key}={EXAMPLES[key]}")
    if not eq or key not in KEYS:
        raise TryError(f"--try {text!r}: expected KEY=VALUE with KEY one of "
                       f"{', '.join(KEYS)} (e.g. --try lr=0.1x, --try lr[1]=1e-4 for group "
                       "1's alone, --try eps=1e-8), or auto")
    if key == "lr":
        if value.endswith("x"):
            return text, Change(lr_factor=_number(text, value[:-1], "a factor such as 0.1x",
                                                  positive=True), lr_group=group)
        return text, Change(lr=_number(text, value, "a learning rate such as 1e-4"),
                            lr_group=group)
    if key == "eps":
        return text, Change(eps=_number(text, value, "an epsilon such as 1e-8"))
    if key == "wd":
        return text, Change(weight_decay=_number(text, value, "a weight decay such as 0.01"))
    if key == "clip":
        return text, Change(clip=_number(text, value, "a maximum gradient norm such as 1.0",
                                         positive=True))
    if key in GROWING:  # (Rprop's: replay.update_bound)
        try:
            return text, Change(hyper=((key, parse_pair(text, key, value)),))
        except ValueError as e:
            raise TryError(str(e)) from None
    if key == "dtype":
        if value not in DTYPES:
            raise TryError(f"--try {text!r}: dtype must be one of {', '.join(DTYPES)}")
        return text, Change(dtype=DTYPES[value])
    try:
        rows = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise TryError(f"--try {text!r}: drop takes sample indices separated by commas "
                       "(e.g. drop=3,7)") from None
    if rows[0] < 0:
        raise TryError(f"--try {text!r}: sample indices are >= 0")
    return text, Change(drop=rows)


def _number(text: str, value: str, what: str, positive: bool = False) -> float:
    try:
        v = float(value)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise TryError(f"--try {text!r}: {value!r} is not {what} (a finite number "
                       f"{'> 0' if positive else '>= 0'})")
    return v


def check_applicable(step: Step, label: str, change: Change) -> None:
    """Refuse (one line) a try the bundle cannot take: an optimizer setting without an
    optimizer or a parameter group that has it, rows past the batch."""
    opt = step.optimizer
    needs = [k for k, v in (("lr", change.lr if change.lr is not None else change.lr_factor),
                            ("eps", change.eps), ("weight_decay", change.weight_decay),
                            ("clip", change.clip)) if v is not None] + [k for k, _ in change.hyper]
    if needs and opt is None:
        raise ReplayError(f"--try {label}: the bundle's optimizer was not rebuilt, so there is "
                          "no update to change")
    if opt is not None:
        check_group(opt, label, change)
    for k in needs:
        if k != "clip" and not all(k in g for g in opt.param_groups):
            # (the keys this optimizer does take: SGD has a weight decay, Adafactor no lr)
            has = [key for key, name in (("lr", "lr"), ("eps", "eps"), ("wd", "weight_decay"),
                                         *((k, k) for k in GROWING))
                   if all(name in g for g in opt.param_groups)]
            raise ReplayError(f"--try {label}: {type(opt).__name__} has no '{k}' setting; "
                              f"try another key ({', '.join(has + ['clip'])})")
    if change.drop:
        n = batch_size(step, i := _samples_micro_batch(step, None) or 0)
        if not n and empty_micro_batch(step, i):  # (size 0 is also "unknown")
            raise ReplayError(f"--try {label}: the batch{f' of micro-batch {i}' if i else ''} "
                              "has no sample, so there is none to drop")
        if n and change.drop[-1] >= n:
            raise ReplayError(f"--try {label}: the batch has {n} samples (0-{n - 1}); pass "
                              "indices within it")
        if n and len(change.drop) >= n:
            raise ReplayError(f"--try {label}: that drops every sample of the batch")


HALF = ("float16", "bfloat16")


def _lr_kinds(groups) -> tuple[bool, bool]:
    """(a group's lr is NaN, +-Inf or below 0: a decay run past its end, whose fraction
    climbs the loss too; a group's lr is None: a relative step size, Hugging Face's
    Adafactor's, which no factor scales)."""
    lrs = [g.get("lr", 0.0) for g in groups]
    bad = [v for v in lrs if v is not None and not 0 <= float(v) < math.inf]
    return bool(bad), any(v is None for v in lrs)


def _overflowed_in(o: dict[str, Any]) -> str | None:
    """The type an overflow beat: the chain's first op's (a float16 mm under autocast) when
    the origin is a later float32 op that took its infinity, else the origin's."""
    return next((c["dtype"] for c in o.get("chain") or ()
                 if c.get("dtype") and not c.get("intentional")), o.get("dtype"))


def auto_tries(step: Step, report: dict[str, Any]) -> list[str]:
    """The remedies that fit the cause: drop the offending samples for bad input, an op's
    domain or an overflow in samples whose inputs are outliers of the batch, a wider compute
    type for an overflow (float32 under float16/bfloat16) or a half type's underflow, a
    smaller learning rate and clipping for an update or a growth that began steps before (the
    last finite positive learning rate instead, when the update's was itself NaN, Inf or
    below 0: a fraction of it is too), a non-zero eps for an optimizer with ``eps=0``. None for weights written
    outside ``optimizer.step()``: no change to the steps a re-run replays reaches that
    write."""
    cause, o = report.get("cause"), report.get("origin") or {}
    out: list[str] = []
    # (a pair's partner goes too; the samples of other nodes at the same pole too)
    samples = o.get("coupled") or drop_with_others(o)
    # (not the rows a per-pair loss argument reached: that argument keeps its own rows)
    fits_drop = cause in ("input", "invalid", "underflow", "precision") and not o.get("grouped")
    # an overflow in samples whose inputs are outliers of the batch points at their data too
    # (a record in the wrong unit), as does one spanning the batch (a BatchNorm mixes the
    # rows) whose inputs hold a few such rows: dropping them tells the data from the model
    if cause == "overflow" and (scaled := out_of_scale(step, o)) is not None:
        samples, fits_drop = scaled[0], True
    # a bad record is a few rows; when most of the batch fails, the model (a rate head with
    # no positive activation) is at fault, and a batch without them proves nothing
    n = o.get("batch_size")
    few = not n or 2 * len(samples) <= n
    if fits_drop and samples and few and not undroppable(step, o.get("micro_batch") or 0):
        out.append("drop=" + ",".join(str(s) for s in samples))
    out += _dtype_tries(step, report, cause, o)
    began = ((report.get("window") or {}).get("precursors_began") or {}).get("step")
    grew = began is not None and began < (report.get("event") or {}).get("step", began)
    # (a rate below 0 before the event: whatever the cause, its updates climbed the loss)
    fits_update = cause in ("optimizer", "overflow") or (grew and cause != "weights") \
        or below_zero(step) is not None
    # an update whose own op left its domain (a trust ratio's 0/0) where no eps of the
    # optimizer's is at fault: any rate, any clip, makes the same value
    if cause == "optimizer" and o.get("domain") and step.optimizer is not None \
            and not _eps_tries(step, o.get("params") or []):
        # (but a division a rate of 0 made: the rate the update is finite at, replay.zero_rate)
        return out + ([f"lr={o['zero_rate']:g}"] if o.get("zero_rate") else [])
    if step.optimizer is not None and fits_update:
        bad_lr, relative = _lr_kinds(step.optimizer.param_groups)
        # (a rate the weights' dtype cannot hold, ASGD's lr=1e39: no fraction of it is usable)
        huge = lr_beyond_dtype(step, step.optimizer.param_groups, o.get("params") or [])
        if huge and (use := usable_lr(step)) is not None:
            out.append(f"lr={use:g}")
        elif not bad_lr:
            # (an update of the gradient's sign: the knobs bounding its size, no clipping)
            out += bound_tries(step) or (["clip=1.0"] if relative else ["lr=0.1x", "clip=1.0"])
            # (the rate the run trained at before the jump: the window's, else the ring's)
            if (before := lr_before_jump(report) or _group_before_jump(step)) is not None:
                out.append(before)
            # (weights times |c| >= 1: a decay's factor, SGD's coupled growth: decay_divergence)
            out += decay_tries(step, report)
        elif (last := last_finite_lr(step)) is not None:
            out.append(last)
        if cause == "optimizer":
            out += _eps_tries(step, o.get("params") or [])
    return out


def _dtype_tries(step: Step, report: dict[str, Any], cause, o: dict[str, Any]) -> list[str]:
    """The compute type that fits the cause, if one does (see :func:`auto_tries`)."""
    hint = report.get("hint") or ""
    loss = o.get("phase") == "loss"  # (a loss the loop ran outside the forward's autocast)
    low = any(m.get("dtype") in HALF for m in step.meta.get("modules", [])) \
        or any(autocast_dtype(mb, loss) for mb in step.micro_batches)
    # (an op computing in float32 under autocast needs float64; one overflowing bfloat16,
    # with float32's range, too; one whose true result float64 overflows, no type)
    if cause == "overflow" and BEYOND_FLOAT64 not in hint:
        made_in = _overflowed_in(o)
        return ["dtype=float32" if (made_in == "float16" if made_in else low)
                else "dtype=float64"]
    if cause in ("underflow", "precision") and (low or o.get("dtype") in HALF) \
            and BELOW_FLOAT32 not in hint:
        # a value float16 rounds to 0 is normal in float32; a difference bfloat16's 8 bits
        # cancel below 0 keeps its sign (also where the op took a half output outside autocast)
        return ["dtype=float32"]
    if cause == "precision" and (o.get("dtype") or "float32") == "float32":
        return ["dtype=float64"]  # (float32's rounding crossed a boundary float64's did not)
    if cause == "optimizer" and HALF_UPDATE in hint:  # (weights and state kept in a half type)
        return ["dtype=float32"]
    return []


def _eps_tries(step: Step, params: list[str]) -> list[str]:
    """For an update that divided by an eps of 0, or by one its weights' dtype rounds to 0
    (Adam's 1e-8 in float16): an eps that dtype keeps and, for the latter, float32 weights and
    state."""
    groups = (step.meta.get("optimizer") or {}).get("param_groups", [])
    if lost := eps_lost(step, groups, params):
        return [f"eps={safe_eps(lost[1])}", "dtype=float32"]
    if lost := squared_eps_lost(step, groups, params):  # (Adafactor's: the try sets eps1)
        return [f"eps={default_eps1(lost[1])}"]
    if any(g.get("eps") == 0 for g in step.optimizer.param_groups):
        dtype = _weights_dtype(step)
        return [f"eps={safe_eps(dtype and str(dtype).removeprefix('torch.'))}"]
    return []


def _weights_dtype(step: Step) -> torch.dtype | None:
    """The dtype of the run's first floating weight, None when the bundle holds none."""
    return next((t.dtype for k, t in step.tensors.items()
                 if k.startswith("weights/") and t.is_floating_point()), None)


def _from_the_copy(win: Window, report: dict[str, Any]) -> None:
    """For tries re-run from a rewind window: what its re-run found, and the note of a copy
    taken after the run began to grow (once for every try)."""
    if win.from_rewind and report.get("window"):
        _as_the_window_found(win, report["window"])
    if win.from_rewind and (late := late_window_note(report, win.records[0]["step"])):
        report["problems"].append(late)


def _as_the_window_found(win: Window, w: dict[str, Any]) -> None:
    """The loop's clip, loss factors and unscaling the window's re-run found, for its tries."""
    win.loop_clip, win.loss_factors = w.get("loop_clip"), w.get("loss_factors")
    win.loop_unscale, win.loop_zeroes = bool(w.get("loop_unscale")), bool(w.get("loop_zeroes"))


def run_tries(step: Step, report: dict[str, Any], tries: list[str]) -> list[dict[str, Any]]:
    """Each try re-run separately: ``{"try", "finite", "inconclusive", "event_step", "origin",
    "steps"}``. A try is inconclusive when the re-run without any change is finite too (a
    weight edited by hand between steps, which no re-run replays): its result is no evidence
    of a fix. ``auto`` proposing nothing adds a note to ``report["problems"]``."""
    parsed = _parsed(step, report, tries)
    win = window_of(step)
    why = ("nothing can be re-run from this bundle" if step.model is None else
           AFTER_UPDATE if win is None and step.meta.get("state") == "after_update" else None)
    if why:
        return [{"try": label, "finite": None, "inconclusive": None, "event_step": None,
                 "origin": None, "note": why} for label, _ in parsed]
    if not parsed:
        return []
    for label, change in parsed:
        check_applicable(step, label, change)
    win = win or step_as_window(step)
    _from_the_copy(win, report)
    unchanged_finite = _unchanged_finite(step, report, win)
    out = []
    for label, change in parsed:
        if _update_only(change) and (note := _update_untestable(step, report, win, label)):
            out.append(_no_verdict(label, note=note))
            continue
        if change.drop:
            change.drop_step = step.event.get("step")
            i = _samples_micro_batch(step, report)
            change.drop_micro_batch = None if i is None else compared_with(step, i)
            if why := undroppable(step, i or 0):
                out.append(_no_verdict(label, note=why))
                continue
        try:
            res = run_window(step, win, change)
        except Exception as e:  # (the replay's own failure on this change: the others stand)
            out.append(_no_verdict(label, error=f"{type(e).__name__}: {one_line(e)}"))
            continue
        if res.raised:  # no evidence of finite: the run ended where the model's code raised
            out.append(_no_verdict(label, error=res.raised + left_by(step, change)))
            continue
        o = res.first
        if _recorded_loss_input(step, report, o):
            out.append(_no_verdict(label, ran=True, note=RECORDED_LOSS_INPUT))
            continue
        entry: dict[str, Any] = {"try": label, "finite": o is None,
                                 "inconclusive": unchanged_finite,
                                 "event_step": o.step if o else None,
                                 "origin": _origin(o) if o else None,
                                 "steps": [win.records[0]["step"], win.records[-1]["step"]]}
        if o is None:  # the re-run's loss at its last step, and whether it still diverges
            entry["loss"] = res.per_step[-1]["loss"] if res.per_step else None
            entry["diverging"] = still_diverging(entry["loss"], report.get("window"))
            entry["beyond"] = beyond_run_type(entry["loss"], _weights_dtype(step))
        if notes := _notes(res, report, win) + _every_group(step, win, label, change):
            entry["note"] = "; ".join(notes)
        out.append(entry)
    return out


def _notes(res, report: dict[str, Any], win: Window) -> list[str]:
    """The try's re-run's own notes (those the report has not), and, for a rewind window that
    departed from the run, that the try proves nothing."""
    notes = [p for p in res.problems if p not in report.get("problems", ())]
    if win.from_rewind and (gone := tries_note(report)) is not None:
        notes.append(gone)
    return notes


def _group_before_jump(step: Step) -> str | None:
    j = jumped_group(step)
    return None if j is None else f"lr[{j['group']}]={j['before']:.3g}"


def _every_group(step: Step, win: Window, label: str, change: Change) -> list[str]:
    """The note of an ``lr=VALUE`` that set groups recorded at different rates (at the event
    step: a later record's rates are what the loop set after it)."""
    at = next((r for r in win.records if r["step"] == step.event.get("step")), win.records[-1])
    note = every_group_note(at.get("hyper"), label, change)
    return [note] if note else []


def _parsed(step: Step, report: dict[str, Any], tries: list[str]) -> list[tuple[str, Change]]:
    """(label, change) of each try, ``auto`` expanded to what it proposes (a note when that is
    nothing), each label once."""
    parsed: list[tuple[str, Change]] = []
    for text in tries:
        label, change = parse_try(text)
        if change is None:
            proposed = [parse_try(t) for t in auto_tries(step, report)]
            if not _update_before_event(step, window_of(step) or step_as_window(step)):
                # (a change of the updates cannot alter such a re-run: said when asked for,
                # not proposed)
                proposed = [(t, c) for t, c in proposed if not _update_only(c)]
            parsed += proposed
            if not proposed:
                report["problems"].append(_nothing_to_try(report.get("cause")))
        else:
            parsed.append((label, change))
    seen: set[str] = set()  # (auto may propose what was asked for already)
    return [(label, c) for label, c in parsed if not (label in seen or seen.add(label))]


def _update_only(change: Change) -> bool:
    """The change acts on the updates alone (learning rate, eps, weight decay, clipping)."""
    return change.dtype is None and not change.drop and (bool(change.hyper) or any(
        v is not None for v in (change.lr, change.lr_factor, change.eps, change.weight_decay,
                                change.clip)))


def _update_untestable(step: Step, report: dict[str, Any], win: Window, label: str) -> str | None:
    """Why an update-only try cannot test a fix: the event's weights were updated by an
    optimizer the recorder was not given (replay.foreign_update), or no update runs before
    the event in the re-run; None when it can."""
    if note := try_note(step, report):
        return note
    return None if _update_before_event(step, win) else NO_UPDATE_BEFORE.format(
        key=label.partition("=")[0], step=step.event.get("step"))


def _update_before_event(step: Step, win: Window) -> bool:
    """Whether the re-run applies an update before the event: one of a window step before the
    event's, or the event step's own when the event is in that update (``optimizer``)."""
    at = step.event.get("step")
    return step.event.get("phase") == "optimizer" or (
        at is not None and win.records[0]["step"] < at)


def _samples_micro_batch(step: Step, report: dict[str, Any] | None) -> int | None:
    """The micro-batch whose samples the report names (its origin's, else the event's)."""
    if len(step.micro_batches) < 2:
        return None
    i = ((report or {}).get("origin") or {}).get("micro_batch")
    return i if isinstance(i, int) else step.event.get("micro_batch")


def _unchanged_finite(step: Step, report: dict[str, Any], win: Window) -> bool:
    """Whether the re-run without any change stays finite to its last step: the rewind
    window's own re-run (the report's ``window``), else the recorded step's, run here. (A run
    the model's code ended by raising has no entry for that step.)"""
    w = report.get("window")
    if win.from_rewind and w is not None:
        first, per_step = w["first_non_finite"], w["per_step"]
    else:
        res = run_window(step, win)
        first, per_step = res.first, res.per_step
    return first is None and len(per_step) == len(win.records)


def _nothing_to_try(cause: str | None) -> str:
    if cause == "weights":
        return ("--try auto: no what-if fits a weights cause: the weights were written outside "
                "optimizer.step(), which no re-run replays, so no change to the recorded steps "
                "can test a fix")
    return (f"--try auto: no what-if fits the cause ({cause or 'unknown'}); pass a change "
            "with --try KEY=VALUE")


def _origin(o) -> dict[str, Any]:
    return {"step": o.step, "phase": o.phase, "module": o.module, "call": o.call,
            "micro_batch": o.micro_batch, "params": o.params, "kind": o.kind, "op": o.op,
            **({"state": o.state} if o.state else {})}


def _recorded_loss_input(step: Step, report: dict[str, Any], o) -> bool:
    """The try's first event is the loss's input at the event step while the event was not an
    input event on a loss argument: a recorded loss input held the NaN the model made (see
    RECORDED_LOSS_INPUT), also the NaN of a model input that the try dropped (a blank frame's
    row of FixMatch's interleaved batch, whose output the loop de-interleaved and sliced)."""
    origin = report.get("origin") or {}
    return o is not None and o.phase == "input" and o.module == "<loss>" \
        and o.step == step.event.get("step") \
        and not (origin.get("phase") == "input"
                 and str(origin.get("tensor") or "").startswith("loss_"))


def _no_verdict(label: str, **why: Any) -> dict[str, Any]:
    """A try without a verdict: why not (``note``, ``error``; ``ran``: re-run, but it proves
    nothing)."""
    return {"try": label, "finite": None, "inconclusive": None, "event_step": None,
            "origin": None, **why}
