"""Is the rebuilt model the recorded one? The re-run's per-call statistics against the ring's.

A factory cannot see run-time configuration (command-line flags, globals, config files), so it
may build a model other than the one that trained: same parameters, different computation.
Before anything is localised, the instrumented re-run's (min, max) of every module call is
compared with the recorded event step's, call by call (module, micro-batch, k-th call), over
each micro-batch's forward (the calls that complete by the root's) up to the first call the
recorder saw non-finite (what follows it depends on the bad value). A call
whose values differ beyond float tolerance (1% relative on the recorded device), one missing
from the re-run, a module the recorded model did not have, or one the re-run called but the
recorded step did not (code that never ran in training) means the factory built a different
model.

>>> fid = compare(step, run)                                   # doctest: +SKIP
>>> fid["matches"], fid["module"]
(False, 'scale')
"""

from __future__ import annotations

import math
from typing import Any

from recorder.finite import matches, pair_ok

from . import added_layers as added
from .cause_text import module_label
from .load import Step, recorded_device
from .local_shards import SLICED, SLICED_WHY, tensor_parallel, within
from .module_hooks import missing_text
from .run_result import Run
from .same_build import SAME_BUILD, same_build
from .world_forward import MISMATCH as WORLD_MISMATCH
from .world_forward import describe as world_describe
from .world_forward import world_forward
from .written_notes import changed_params as _changed_params

# Float tolerance (relative, absolute). The same device may still differ a little: thread
# counts reorder reductions, training may have run float32 matmuls as TF32 (about 1e-3
# relative); another device (a GPU bundle replayed with --device cpu) runs other kernels. A
# model built from other settings differs by far more.
SAME_DEVICE, OTHER_DEVICE, ABS = 1e-2, 5e-2, 1e-5


def compare(step: Step, run: Run, written: list[str] = ()) -> dict[str, Any] | None:
    """``{"matches", "module", "call", "micro_batch", "recorded", "rerun", "calls",
    "difference", "basis"}``, or None when the bundle holds no recorded statistics to compare
    with (no history); ``written``: the frozen parameters the re-run's forward wrote.
    ``basis`` is ``"event step"`` (values, call by call) or, for an evaluation forward, which
    the ring does not keep, ``"earlier steps"``: only which modules the recorded training
    steps called."""
    t, meta = step.tensors, step.meta
    ev = step.event
    fields = meta.get("ring", {}).get("call_fields", [])
    if "ring/steps" not in t or not run.calls or "min" not in fields or "max" not in fields:
        return None
    names = [m["name"] for m in meta.get("modules", [])]
    rows = [] if ev.get("evaluation") else \
        [i for i, s in enumerate(t["ring/steps"].tolist()) if s == ev.get("step")]
    if rows:
        found = _event_step(step, run, rows[-1], names, fields)
    else:
        found = _modules_called(step, run, range(t["ring/steps"].numel()), names, 0)
    if found is None:
        return None
    found["basis"] = "event step" if rows else "earlier steps"
    found["changed"] = list(meta.get("changed_in_step") or []) or None
    # (trained tensor attributes: stepped by an optimizer the recorder was not given)
    reused = {j for j, m in enumerate(step.micro_batches) if m.get("taken_again")}
    if (found["changed"] or step.trained or found["micro_batch"] in reused
            or _moved(step) is not None) and not found["matches"] and rows:
        found = _after_change(step, run, rows[-1], names, fields, found)
    if not found["matches"] and step.code_edits:  # (first: the user's edit, see the note)
        found["code_edited"] = step.code_edits
    elif not found["matches"] and (after := added.after_attach(step)):  # (not recorded)
        found["added"] = after
    elif not found["matches"] and step.built_otherwise:  # (the re-run took another path)
        found["built_otherwise"] = step.built_otherwise
    elif rows and not found["matches"] and (world := world_forward(step, found["module"])):
        found["world"] = world  # (statistics over every rank's batch: SyncBatchNorm's)
    elif rows and not found["matches"] and tensor_parallel(meta):
        found["sliced"] = True  # (a module computed on a slice otherwise than on the whole)
    elif rows and not found["matches"] and not found["changed"] and written:
        # (the recorder bundles parameters as the step left them: these, one write later)
        found["frozen_written"] = list(written)
    elif rows and not found["matches"] and not found["changed"]:
        found["edited"] = edited_since_update(step, rows[-1]) or None
        # (moved and moved back to what the update left, which the norms cannot see: the
        # recorder's version counter saw the loop's in-place write after the forward)
        found["moved_after"] = (not found["edited"] and _moved(step) is None
                                and bool(meta.get("weights_moved_in_step"))) or None
    if not found["matches"] and found.get("difference") == "values differ":
        found["same_build"] = same_build(step) or None
    return found


def _after_change(step: Step, run: Run, r: int, names, fields, found) -> dict[str, Any]:
    """Parameters another optimizer stepped between the step's forwards (DARTS's alphas,
    stepped on a validation batch before the weights' forward on a training batch): the
    forwards before that step ran on values the bundle no longer holds, the later ones on the
    bundle's. When the first difference is in a forward before the event's and the event's
    forward re-runs as recorded, call by call, the re-run is the recorded step from there:
    a match, with the earlier forwards named (``before_change``). Likewise a first difference
    in a forward whose input tensor the next one took again (``taken_again``: a sampler
    stepping it in place through ``.data``), named as ``reused``."""
    mb = step.event.get("micro_batch")
    if not isinstance(mb, int) or found["micro_batch"] is None or found["micro_batch"] >= mb:
        return found
    later = _event_step(step, run, r, names, fields, first=mb)
    moved = _moved(step)
    # (a forward whose input the loop stepped in place: no other cause for the difference)
    reused = None if found["changed"] or step.trained or moved is not None \
        else found["micro_batch"]
    if later is None or not later["matches"] or not (later["calls"] or reused is not None
                                                      or moved is not None):
        return found
    later.update(basis=found["basis"], changed=found["changed"], before_change=list(range(mb)),
                 trained=None if found["changed"] else step.trained,
                 reused=reused, moved=moved)
    return later


def _moved(step: Step) -> int | None:
    """The first micro-batch, up to the event's, that ran on weights moved in place since the
    step's earlier forward (``weights_moved``: SAM's ascent to w + e), else None. Moved inside
    the optimizer's ``step(closure)``, the event came before the move was undone: the bundle
    holds the moved weights, which only the forwards from that micro-batch on ran with."""
    at = step.event.get("micro_batch")
    if not isinstance(at, int):
        return None
    return next((i for i, m in enumerate(step.micro_batches[:at + 1])
                 if m.get("weights_moved")), None)


def edited_since_update(step: Step, r: int) -> list[str]:
    """The parameters whose bundled weights are not what the last update left them (their
    2-norm right after it, the ring's ``update_norms`` of the event step): written outside
    ``optimizer.step()`` since. When the re-run then differs from the recording, the write
    came during the step, after a forward read the old values (a clamp or a ``fill_`` under
    ``no_grad`` between the forward and the loss). Only for a bundle of unsharded weights taken
    before the update."""
    t, meta = step.tensors, step.meta
    norms = t.get("ring/update_norms")
    if norms is None or meta.get("state") != "before_update" or {"shards", "shard_set"} & set(meta):
        return []
    out = []
    for name, after in zip(meta.get("params") or [], norms[r].double().tolist()):
        w = t.get(f"weights/{name}")
        if w is None or not w.is_floating_point() or not math.isfinite(after):
            continue
        now = float(w.detach().double().norm())
        if not math.isclose(now, after, rel_tol=1e-3, abs_tol=1e-6):
            out.append(name)
    return out


def _event_step(step: Step, run: Run, r: int, names: list[str], fields: list[str],
                first: int = 0):
    """The event step's calls against the re-run's, from micro-batch ``first`` on."""
    t, meta = step.tensors, step.meta
    recorded_on = recorded_device(meta)
    rel = SAME_DEVICE if recorded_on is None or recorded_on == step.device else OTHER_DEVICE
    allowed = meta.get("allow_inf", [])
    stats = t["ring/calls"][r, :, [fields.index("min"), fields.index("max")]].tolist()
    mods = t["ring/call_module"][r].tolist()
    mbs = t["ring/call_micro_batch"][r].tolist()
    rerun = _rerun_pairs(run)
    sliced = tensor_parallel(meta)  # (the recorded statistics may be of activation slices)
    seen: dict[tuple[str, int], int] = {}
    # micro-batches whose root call completed, or which the re-run skips (recorder.abandoned)
    done = {i for i, m in enumerate(step.micro_batches) if m.get("abandoned")}
    compared = 0
    for (lo, hi), m, mb in zip(stats, mods, mbs):
        if m < 0 or m >= len(names) or mb in done or mb < first:  # past a truncated row's
            continue  # end; after the forward (checkpointing's recomputation, a loop calling
            # a submodule); before the forwards compared
        name = names[m]
        k = seen.get((name, mb), 0)
        seen[(name, mb)] = k + 1
        if name == "":
            done.add(mb)
        soft = matches(name, allowed)
        if not pair_ok(lo, hi):
            if soft and pair_ok(lo, hi, allow_inf=True):
                continue  # an intended -inf mask
            if math.isnan(lo) and math.isnan(hi) and not _had_float(rerun, name, mb, k):
                continue  # a call with no floating output
            break  # the first non-finite call: what follows depends on it
        got = rerun.get((name, mb, k))
        if got is None:
            return _differs(name, k, mb, [lo, hi], None, compared, "did not run in the re-run")
        if not (_close(lo, got[0], rel) and _close(hi, got[1], rel)) and not (
                sliced and within(lo, hi, got, lambda a, b: _close(a, b, rel))):
            found = _differs(name, k, mb, [lo, hi], list(got), compared, "values differ")
            # an earlier forward of the step re-ran whole and as recorded: the model is the
            # recorded one, and what this forward ran with changed within the step
            found["within_step"] = bool(done) and mb not in done
            return found
        compared += 1
    return _modules_called(step, run, [r], names, compared)


def _modules_called(step: Step, run: Run, rows, names: list[str], compared: int):
    """A module the re-run called that the recorded steps ``rows`` never did (code that did
    not run in training), or one the recorded model does not have; else a match."""
    meta = step.meta
    mods = step.tensors["ring/call_module"][list(rows)].flatten().tolist()
    called = {names[m] for m in mods if 0 <= m < len(names)}
    if not called:
        return None
    regions = meta.get("compiled_regions")  # their insides are not recorded call by call
    complete = (regions is not None and run.error is None
                and not meta.get("ring", {}).get("truncated_rows"))
    # modules whose output is another call's (a plain Sequential, an Identity) have no calls
    # of their own (bundles of earlier recorders record them)
    passing = set(meta.get("passthrough_modules", ()))
    rerun = _rerun_pairs(run)
    for c in run.calls:
        why = ("not in the recorded model" if c.module not in names else
               "did not run in training" if complete and c.module not in called
               and c.module not in passing and not _inside(c.module, regions) else None)
        if why is not None:
            return _differs(c.module, c.call, c.micro_batch, None,
                            list(rerun.get((c.module, c.micro_batch, c.call), ())), compared,
                            why)
    return {"matches": True, "module": None, "call": None, "micro_batch": None,
            "recorded": None, "rerun": None, "calls": compared, "difference": None}


def _rerun_pairs(run: Run) -> dict[tuple[str, int, int], tuple[float, float]]:
    """(module, micro-batch, k-th call) -> (min, max) over the call's floating outputs."""
    out = {}
    for c in run.calls:
        pairs = [(float(a), float(b)) for a, b in c.minmax]
        if pairs:
            out[(c.module, c.micro_batch, c.call)] = (min(a for a, _ in pairs),
                                                      max(b for _, b in pairs))
    return out


def _inside(name: str, regions: list[str]) -> bool:
    return any(name.startswith(r + ".") if r else name != "" for r in regions)


def _had_float(rerun, name: str, mb: int, k: int) -> bool:
    return (name, mb, k) in rerun


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=ABS)


def _differs(module: str, call: int, mb: int, recorded, rerun, compared: int,
             difference: str) -> dict[str, Any]:
    return {"matches": False, "module": module, "call": call, "micro_batch": mb,
            "recorded": None if recorded is None else {"min": recorded[0], "max": recorded[1]},
            "rerun": None if not rerun else {"min": rerun[0], "max": rerun[1]},
            "calls": compared, "difference": difference}


def mismatch(fid: dict[str, Any]) -> str:
    """Why the re-run is not the recorded step, in a few words for the cause."""
    if fid.get("code_edited"):
        return CODE_EDITED_WHY
    if fid.get("added"):
        return added.WHY
    if fid.get("built_otherwise"):
        return "the factory builds the model's attributes otherwise than the run had them"
    if fid.get("changed") or fid.get("edited") or fid.get("moved_after"):
        return "its weights are not those the step ran with"
    if fid.get("frozen_written"):
        return ("the model's forward writes parameters the bundle holds as that forward left "
                "them")
    if fid.get("within_step"):
        return "a forward of the step ran with other weights than the bundle holds"
    if fid.get("sliced"):
        return SLICED_WHY
    if fid.get("world"):
        return WORLD_MISMATCH
    if fid.get("same_build"):
        return "a forward of the step ran with other weights, or the factory computes otherwise"
    return "the factory builds a different model"


def describe(fid: dict[str, Any]) -> str:
    """One sentence for the text report."""
    name = module_label(fid["module"])
    rec, got, diff = fid["recorded"], fid["rerun"], fid["difference"]
    if diff == "values differ":
        what = (f"gave [{rec['min']:.6g}, {rec['max']:.6g}] in training but "
                f"[{got['min']:.6g}, {got['max']:.6g}] in the re-run")
    elif diff == "did not run in the re-run":
        what = "did not run in the re-run although it ran in training"
    elif diff == "did not run in training":
        what = ("ran in the re-run but not in the recorded step"
                if fid.get("basis") == "event step" else
                "ran in the re-run but in none of the recorded training steps")
    else:
        what = "ran in the re-run but is not in the recorded model"
    after = f", after {fid['calls']} call(s) that agree" if fid["calls"] else ""
    head = f"'{name}' (call {fid['call']}, micro-batch {fid['micro_batch']}) {what}{after}: "
    if fid.get("code_edited"):
        return head + CODE_EDITED
    if fid.get("added"):
        return head + added.text(fid["added"])
    if built := fid.get("built_otherwise"):
        more = f" (+{len(built) - 3} more)" if len(built) > 3 else ""
        return head + BUILT_OTHERWISE.format(attrs=", ".join(built[:3]) + more)
    if fid.get("changed"):
        return head + _changed_params(fid["changed"]) + " changed during the step (see the note)"
    if fid.get("edited"):
        names = fid["edited"]
        return head + _changed_params(names) + (" differs" if len(names) == 1 else " differ") \
            + EDITED
    if fid.get("moved_after"):
        return head + MOVED_AFTER
    if fid.get("frozen_written"):
        return head + _changed_params(fid["frozen_written"]) + FROZEN_WRITTEN
    if fid.get("within_step"):
        return head + WITHIN_STEP
    if fid.get("sliced"):
        return head + SLICED
    if fid.get("world"):
        return head + world_describe(fid["world"])
    if fid.get("same_build"):
        return head + SAME_BUILD
    return head + ("the factory builds a different model than the one recorded (it cannot see "
                   "run-time configuration: command-line flags, globals, config files); record "
                   "with FlightRecorder(..., factory_kwargs={...}) or pass --factory-kwargs "
                   "'{...}' so it builds the same one")


CODE_EDITED_WHY = "the model's code was edited since the run"
CODE_EDITED = ("the model's code was edited since the run (see the note): replay with the "
               "code the run ran, its commit if the bundle names one")


def rebuilt_otherwise(step: Step) -> str:
    """The hint of an event the re-run does not make that the bundle can explain by the model
    the factory built: with number attributes the run had otherwise, or without forward hooks
    the training code registered (:mod:`replay.module_hooks`); ``""`` otherwise."""
    if built := step.built_otherwise:
        more = f" (+{len(built) - 3} more)" if len(built) > 3 else ""
        return BUILT_OTHERWISE.format(attrs=", ".join(built[:3]) + more)
    return missing_text(step)


BUILT_OTHERWISE = (
    "the factory builds a different model than the one recorded: it builds {attrs}, which the "
    "run had when the recorder attached, so the re-run's forward took another path. Built with "
    "other arguments: pass them (--factory-kwargs '{{...}}', or record them with "
    "FlightRecorder(..., factory_kwargs=)); set after building (a data-dependent "
    "initialisation pass, as Glow's ActNorm runs on a first batch): attach the recorder "
    "before setting them (it then bundles them and the replay sets them)")

OTHER_PATH = (
    "when the recorder attached, the run's modules differed from what the factory builds: "
    "{attrs}; the re-run agrees with the recording call by call, but it ran the code the "
    "factory's values select, which may not be the run's (the source line may be another "
    "branch's); pass "
    "the run's values (--factory-kwargs '{{...}}', or record them with FlightRecorder(..., "
    "factory_kwargs=)), or set them after "
    "attaching the recorder (it then bundles them and the replay sets them)")

EDITED = (" from what the last optimizer.step() left: written outside it during the "
          "step, after the forward read them (an in-place clamp_ or fill_ under no_grad between "
          "the forward and the loss); the bundle holds the new values, so this forward cannot "
          "be re-run as it ran. Make such edits before the forward or after optimizer.step()")

MOVED_AFTER = (
    "the loop moved the weights the optimizer holds in place after this forward and before "
    "optimizer.step() (the recorder saw their version change in the step): a schedule-free "
    "optimizer's optimizer.train() called after the forward rather than before it (the "
    "forward and its gradients then ran on the eval-mode average x, not the train-mode y "
    "that step() expects), a swap to averaged or EMA weights not undone before the forward; "
    "the bundle holds the weights as moved, so this forward cannot be re-run as it ran. Make "
    "such swaps before the step's first forward (optimizer.train(); model.train() at the top "
    "of the loop) or after optimizer.step()")

FROZEN_WRITTEN = (
    ", which require no gradient, are written by the model's own forward (a hand-written "
    "spectral norm's power iteration, u.data = ..., v.data = ...; a momentum update): the "
    "bundle holds parameters as the step left them, not as it began, so the re-run's forward "
    "starts one write later than training's and differs, though the model is the recorded "
    "one; keep such state in buffers (self.register_buffer('u', ...), as torch's "
    "spectral_norm does), which the recorder bundles as the step began, and record again")

WITHIN_STEP = ("an earlier forward of the step re-ran as recorded, so the model is the recorded "
               "one, but this forward ran with other weights than the bundle holds: parameters "
               "passed in for the call (torch.func.functional_call, as a MAML inner loop does) "
               "or edited between the step's forwards; the bundle holds the model's own, so "
               "this forward cannot be re-run as it ran")


def notes(fid: dict[str, Any] | None, step: Step) -> list[str]:
    """The notes of a re-run that matches: one built with attributes the run had otherwise at
    attach (whose re-run took the factory's code path, though its values agree); one that
    matches from the event's forward on (``_after_change``); parameters added since attach."""
    out = added.notes(fid, step)
    if fid is not None and fid["matches"] and (built := step.built_otherwise):
        more = f" (+{len(built) - 3} more)" if len(built) > 3 else ""
        out.append(OTHER_PATH.format(attrs=", ".join(built[:3]) + more))
    if fid is None or not fid.get("before_change"):
        return out
    before = fid["before_change"]
    which = ("micro-batch " if len(before) == 1 else "micro-batches ") + \
        ", ".join(map(str, before))
    if fid.get("moved") is not None:
        return out + [MOVED.format(which=which, k=fid["moved"], n=before[-1] + 1)]
    if fid.get("reused") is not None:
        return out + [REUSED.format(first=fid["reused"], n=before[-1] + 1, calls=fid["calls"])]
    what = _changed_params(fid["changed"]) if fid.get("changed") else \
        f"tensor attribute{'s' if len(fid['trained']) > 1 else ''} " \
        f"{added.names_text(fid['trained'])}, which another optimizer trains,"
    return out + [f"{which} ran before {what} changed and "
            f"{'differs' if len(before) == 1 else 'differ'} in the re-run; the event's "
            f"forward, micro-batch {before[-1] + 1}, ran after the change on the values the "
            f"bundle holds and re-runs as recorded ({fid['calls']} calls agree)"]


MOVED = (
    "{which} ran before the weights were moved in place for micro-batch {k} (SAM's ascent to "
    "w + e, which step(closure) makes before it calls the closure) and differs in the re-run: "
    "the event came before the move was undone, so the bundle holds the moved weights; the "
    "event's forward, micro-batch {n}, ran on them and is re-run on them")


REUSED = (
    "micro-batch {first} differs in the re-run: it took the very input tensor the next "
    "forward took again, which the loop wrote into between them without moving its version "
    "counter (x.data.add_(...), a Langevin sampler's in-place step), so the bundle holds it "
    "as the last write left it (the recorder keeps copies of the inputs from the next forward "
    "on); the event's forward, micro-batch {n}, re-runs as recorded ({calls} calls before its "
    "first non-finite one agree)")
