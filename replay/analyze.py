"""From a rebuilt step to the report: reproduce, localise, name the op, classify the cause.

>>> step = read_step("nan-bundles/step00000006-rank0.nan")     # doctest: +SKIP
>>> build(step, factory=None, device=None)
>>> report = analyze(step)
>>> report["origin"]["module"], report["origin"]["op"], report["cause"]
('encoder.2.act', 'aten.log', 'invalid')
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
from typing import Any

import torch

from recorder.capture import batch_path, flatten_tree, loss_path, tensor_leaves
from recorder.events import bad_rows, first_bad_rows

from . import cause as causes
from . import fidelity, outside
from .backward import find_backward_origin
from .load import Step, autocast_as_recorded, micro_batch_inputs
from .ops import OpFinder, user_source
from .precursors import find_precursors, history
from .rerun import Run, Runner, StopRun, finite, kind_of

FORMAT = "nanreplay-report/1"


def _origin(**kw) -> dict[str, Any]:
    base = {"phase": None, "module": None, "call": None, "op": None, "param": None,
            "params": [], "tensor": None, "samples": [], "source": None, "chain": [],
            "micro_batch": None, "inputs_finite": None, "made": None, "detail": None}
    base.update(kw)
    return base


def base_report(step: Step) -> dict[str, Any]:
    meta = step.meta
    ev = step.event
    env = meta.get("env", {})
    hist = history(meta, step.tensors)
    dtypes = {m["name"]: m.get("dtype") for m in meta.get("modules", [])}
    return {
        "format": FORMAT,
        "bundle": {"path": str(step.path), "rank": env.get("rank", 0), "torch": env.get("torch"),
                   "stripped": step.stripped},
        "event": {"step": ev.get("step"), "phase": ev.get("phase"), "module": ev.get("module"),
                  "call": ev.get("call"), "micro_batch": ev.get("micro_batch"),
                  "kind": ev.get("kind"), "params": ev.get("params", []),
                  "tensor": ev.get("tensor"), "samples": ev.get("samples", []),
                  "detail": ev.get("detail"), "evaluation": bool(ev.get("evaluation")),
                  "compiled": bool(ev.get("compiled"))},
        "reproduced": False,
        "not_rerun": None,  # why nothing was re-run ("batch and weights stripped"), if so
        "origin": _origin(),
        "cause": None,
        "hint": None,
        "precursors": find_precursors(hist, dtypes=dtypes),
        "bisection": None,
        "fidelity": None,
        "problems": list(step.problems),
        "history": hist,
    }


def analyze(step: Step) -> dict[str, Any]:
    """The report for one bundle (``step`` already passed through :func:`load.build`)."""
    report = _analyze(step)
    o = report["origin"]
    # whether the samples are the whole batch: "all 64 rows" says more than 64 numbers
    o["batch_size"] = _batch_size(step, o.get("micro_batch") or 0) or None
    o["all_samples"] = bool(o["batch_size"]) and o["samples"] == list(range(o["batch_size"]))
    return report


def _analyze(step: Step) -> dict[str, Any]:
    report = base_report(step)
    phase = step.event.get("phase")
    # by the default policy a +-Inf in the batch (a float mask) is bad data only where it leads
    strict = bool(step.meta.get("strict_inf", True))
    if phase == "input" or _batch_non_finite(step, ("batch/",), nan_only=not strict):
        return _finish(report, _input_origin(step, report), "input", reproduced=True)
    bad_weights = _non_finite_weights(step)
    after_update = phase == "optimizer" and step.meta.get("state") == "after_update"
    if bad_weights and not after_update:
        return _weights(report, step, bad_weights)
    if after_update and (bad_weights or "weights" in step.stripped):
        report["problems"].append(
            "the bundle holds the weights after the update that made them non-finite, so the "
            "update cannot be re-run; record with FlightRecorder(..., guard_optimizer=True) to "
            "replay it")
        params = bad_weights or list(step.event.get("params", []))
        return _finish(report, _origin(phase="optimizer", params=params,
                                       param=(params or [None])[0]), "optimizer",
                       reproduced=False)
    if after_update:
        report["problems"].append(
            "the recorded update left non-finite weights, yet every weight in the bundle is "
            "finite: the event does not come back from the bundle; re-running the step instead")
    if step.model is None:
        # Nothing can be re-run (weights stripped, factory refused): say what the recorder saw
        # and leave the cause open rather than guess.
        report = _recorded_origin(report, step, (
            "nothing was re-run, so the op and the cause are unknown: the origin above is what "
            "the recorder saw; replay the full bundle where its factory can be imported to name "
            "the op"))
        parts = sorted(set(step.stripped))
        report["not_rerun"] = (f"{' and '.join(parts)} stripped" if parts
                               else "factory not imported")
        return report
    runner = Runner(step)
    if step.event.get("kind") == "scale":  # a GradScaler event: re-run the scaled backward
        runner.loss_scale = scale_of_the_step(step)
    run1 = runner.run()
    run2 = runner.run()
    if run1.signature() != run2.signature():
        report["problems"].append("two re-runs of the step disagree: nondeterminism")
        return _finish(report, _origin(), "not_reproduced", reproduced=False)
    report["fidelity"] = fid = fidelity.compare(step, run1)
    if fid is not None and not fid["matches"]:
        # what the re-run shows is of another model: nothing it finds is evidence
        return _recorded_origin(report, step, (
            "the factory builds a different model, so the re-run says nothing about training: "
            "the origin above is what the recorder saw; see the fidelity line"))
    origin = run1.forward_origin()
    if not strict and run1.chain()[2]:  # the event's infinity came in with the batch
        return _finish(report, _input_origin(step, report), "input", reproduced=True)
    if run1.error is not None:
        if origin is None and all(run1.loss_finite) and not run1.bad_grads:
            raise run1.error  # it raised before anything went non-finite: the replay failed
        report["problems"].append(
            f"the model's code raised {run1.raised} in the re-run (likely as it did in "
            "training): the replay covers the step up to there")
    if origin is not None:
        return _forward(report, step, runner, run1, origin)
    if run1.loss_finite and not all(run1.loss_finite):
        return _loss(report, step, runner, run1)
    # the recording's forward and loss were finite (a backward event; a loss event of a loss
    # the replay cannot re-run), the re-run's too: did the values enter from outside?
    outside_loss = phase == "backward" or (phase == "loss" and step.loss_fn is None)
    if outside_loss and not run1.bad_grads and \
            (entered := _entering(report, step, runner)) is not None:
        return entered
    if phase == "loss" and step.loss_fn is None:
        return _loss_not_in_bundle(report, step)
    if run1.bad_grads:
        return _backward(report, runner)
    if phase == "optimizer" and not after_update and step.optimizer is not None:
        return _optimizer(report, step, runner)
    report["problems"].append(f"the recorded {phase} event did not come back in the re-run")
    report = _finish(report, _origin(), "not_reproduced", reproduced=False)
    # the two re-runs agree with each other: no reason to suspect the hardware
    report["hint"] = (
        "the two re-runs agree with each other but not with the recording, which they otherwise "
        "match: what decided the event is not in the bundle (state outside the model such as a "
        "counter, a global or a random generator of your own; data-dependent code outside the "
        "recorded model) or it was transient; re-run training from the step before with the "
        "same data to tell which")
    return report


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _recorded_origin(report, step: Step, hint: str) -> dict[str, Any]:
    """The origin the recorder saw, not reproduced and with no cause: nothing re-run is
    evidence (the model could not be rebuilt, or was rebuilt differently)."""
    ev = step.event
    report = _finish(report, _origin(
        phase=ev.get("phase"), module=ev.get("module"), call=ev.get("call"),
        micro_batch=ev.get("micro_batch"), tensor=ev.get("tensor"),
        samples=ev.get("samples", []), params=ev.get("params", []),
        param=(ev.get("params") or [None])[0], made=ev.get("kind"),
        inputs_finite=ev.get("inputs_finite")), None, reproduced=False)
    report["hint"] = hint
    return report


def _entering(report, step: Step, runner: Runner) -> dict[str, Any] | None:
    """The model re-ran finite and as recorded, its backward from the re-run loss (if any) too:
    a non-finite gradient recorded at the model's output came from a loss the replay cannot
    re-run (see replay.outside)."""
    found = outside.entering_origin(step, runner)
    if found is None:
        grads = outside.recorded_output_grads(step)
        if not outside.non_finite_entries(grads):
            return None
        # the model's backward makes non-finite values of its own as well: find them with
        # the entering gradient's non-finite entries set to 0
        runner.out_grads = outside.zeroed(grads)
        try:
            report = _backward(report, runner)
        finally:
            runner.out_grads = None
        report["problems"].append(
            "the gradient entering the model's output was non-finite too (the loss made it); "
            "the backward origin above was found with those entries set to 0")
        return report
    fields, reproduced = found
    report = _finish(report, _origin(**fields), None, reproduced=reproduced)
    info = step.meta.get("loss") or {}
    if info.get("kind") == "recorded":
        report["problems"].append(
            "the loss given to record_loss was computed outside the recorded model, so the "
            "bundle holds its value but nothing to re-run it with")
    elif step.loss_fn is not None:
        report["problems"].append(
            "the loss_fn the replay re-ran is finite with finite gradients: the loop's loss "
            "holds terms computed outside it")
    if not reproduced:
        report["problems"].append(
            "feeding the recorded output gradient through the model's backward did not give "
            "the recorded non-finite parameter gradients back")
    report["hint"] = outside.replayable_loss_hint(step)
    return report


# ---------------------------------------------------------------------------------------------
# phases


def _forward(report, step: Step, runner: Runner, run: Run, o) -> dict[str, Any]:
    # by the default policy a NaN made from NaN-free inputs is searched for as a NaN
    nan_only = not run.strict_inf and o.nan and o.inputs_nan_free
    probe_at, probes = runner.bisect(len(run.calls), nan_only=nan_only)
    agrees = False
    if probe_at is not None:
        found = runner.probe_origin(probe_at, nan_only=nan_only)
        probes += 1
        agrees = found == (o.module, o.call, o.micro_batch)
    # at most ceil(log2 calls) bisection runs, then the one run that finds the origin call
    report["bisection"] = {"probes": probes, "agrees": agrees, "calls": len(run.calls),
                           "limit": _log2_ceil(len(run.calls)) + 1}
    recorded = o
    finder = _find_op_in_call(runner, o.module, o.call, o.micro_batch)
    hit = finder.origin()
    trigger = run.chain()[1] if not run.strict_inf else None
    if hit is None and finder.intentional is not None and trigger not in (None, o):
        # the call where the chain seemed to start only filled an intended +-inf (a mask):
        # the event is the NaN made from it later
        start, o = finder.intentional, trigger
        finder = _find_op_in_call(runner, o.module, o.call, o.micro_batch)
        finder.intentional = finder.intentional or start
        hit = finder.origin()
    if hit is None and finder.intentional is not None:
        # The only non-finite value is a literal +-inf fill that leaves the module as it is.
        hit = finder.intentional
        report["problems"].append(
            f"{hit.op} fills a literal {hit.made} that reaches the output of "
            f"'{o.module or '<root>'}'; if that infinity is intended, record with "
            f"FlightRecorder(..., allow_inf=['{o.module or '*'}'])")
    samples = o.bad_rows if _is_batch_dim(step, o) else _root_rows(run)
    # made: what the blamed op made (the chain's first entry), not what the call returned
    origin = _origin(phase="forward", module=o.module, call=o.call, micro_batch=o.micro_batch,
                     inputs_finite=o.inputs_finite, made=hit.made if hit else o.kind,
                     samples=samples,
                     op=hit.op if hit else None,
                     source=(hit.source if hit and hit.source else _module_source(step, o.module)),
                     chain=finder.chain(),
                     input_range=[hit.input_min, hit.input_max] if hit else None)
    cause = causes.classify(runner, "forward", until=(o.module, o.call, o.micro_batch), hit=hit)
    # (the recorder names the chain's start as module statistics show it: ``recorded``)
    reproduced = _matches(step, origin) or _matches(step, {"module": recorded.module})
    return _finish(report, origin, cause.name, reproduced=reproduced, hint=cause.hint)


def _weights(report, step: Step, bad: list[str]) -> dict[str, Any]:
    """Weights non-finite when the step began. The recorder's evidence from right after the
    last update (``last_update_step``) says the update left them finite: written since, outside
    ``optimizer.step()``."""
    ev = step.event
    seen, last = ev.get("first_seen_step"), ev.get("last_update_step")
    report = _finish(report, _origin(phase="weights", params=bad, param=bad[0],
                                     first_seen_step=seen, last_update_step=last),
                     "weights", reproduced=True)
    if last is not None:
        report["problems"].append(
            f"{bad[0]} was first seen non-finite at step {seen}; the last update (step {last}) "
            "left it finite, so it was written outside optimizer.step() since: an in-place "
            "edit, a checkpoint or state_dict load, another process, a hardware fault")
    return report


def _loss(report, step: Step, runner: Runner, run: Run) -> dict[str, Any]:
    finder = OpFinder(batch_size=_batch_size(step) or None)
    mb = next(i for i, ok in enumerate(run.loss_finite) if not ok)
    args, kwargs = _loss_args(step, run, mb)
    with autocast_as_recorded(step.micro_batches[mb], step.device), finder:
        loss = step.loss_fn(*args, **kwargs)
    made = next((kind_of(t) for t in tensor_leaves(loss) if not finite(t)), None)
    del loss
    hit = finder.origin()
    origin = _origin(phase="loss", module="<loss>", micro_batch=mb, op=hit.op if hit else None,
                     source=hit.source if hit else None, chain=finder.chain(),
                     samples=_loss_samples(step, run, mb) or (hit.rows if hit else None) or [],
                     made=hit.made if hit else made)
    cause = causes.classify(runner, "loss", hit=hit, micro_batch=mb)
    return _finish(report, origin, cause.name, reproduced=step.event.get("phase") == "loss",
                   hint=cause.hint)


def _loss_not_in_bundle(report, step: Step) -> dict[str, Any]:
    """A loss event with no loss to call: one computed inline and given to ``record_loss``
    (the Lightning callback's ``training_step`` loss), or a recorded loss that cannot be
    rebuilt (its note says why). The model's outputs re-ran finite, which is as far as the
    bundle goes."""
    ev = step.event
    report = _finish(report, _origin(phase="loss", module="<loss>",
                                     micro_batch=ev.get("micro_batch"), made=ev.get("kind")),
                     None, reproduced=False)
    if (step.meta.get("loss") or {}).get("kind") == "recorded":
        report["problems"].append(
            "the loss was given to record_loss (computed outside the recorded model), so the "
            "bundle holds its value but nothing to re-run it with; the model's outputs re-ran "
            "finite")
    report["hint"] = ("the loss computation made the value from finite model outputs: check "
                      "its inputs (every target ignored gives a 0/0 mean; log of a zero "
                      "probability). " + _sentence(outside.replayable_loss_hint(step)))
    return report


def _backward(report, runner: Runner) -> dict[str, Any]:
    b = find_backward_origin(runner, _batch_size(runner.step))
    origin = _origin(phase="backward", module=b.module, op=b.node, source=b.source,
                     params=b.params, param=(b.params or [None])[0], made=b.made,
                     samples=b.samples, micro_batch=b.micro_batch,
                     anomaly_node=b.anomaly_node,
                     chain=[{"op": b.node, "made": b.made, "source": b.source}] if b.node else [])
    cause = causes.classify(runner, "backward", node=b.node)
    return _finish(report, origin, cause.name,
                   reproduced=runner.step.event.get("phase") == "backward", hint=cause.hint)


def _optimizer(report, step: Step, runner: Runner) -> dict[str, Any]:
    _decode_non_finite_hyper(step.optimizer)
    runner.run(instrument=False)
    finder = OpFinder()
    with finder:
        step.optimizer.step()
    bad = [n for n, p in step.model.named_parameters() if not finite(p)]
    hit = finder.origin()
    origin = _origin(phase="optimizer", params=bad, param=(bad or [None])[0],
                     op=hit.op if hit else None, source=hit.source if hit else None,
                     chain=finder.chain())
    return _finish(report, origin, "optimizer", reproduced=bool(bad))


def _decode_non_finite_hyper(opt) -> None:
    """The bundle's JSON spells non-finite floats as 'nan', 'inf', '-inf' (``jsonable``); a
    NaN learning rate is exactly what this replay must re-run, so turn them back into floats
    where the optimizer's own default for that hyper-parameter is a float."""
    for group in opt.param_groups:
        for k, v in group.items():
            if isinstance(v, str) and v in ("nan", "inf", "-inf") \
                    and isinstance(opt.defaults.get(k), float):
                group[k] = float(v)


def _input_origin(step: Step, report) -> dict[str, Any]:
    """The batch tensor (or loss target) holding the non-finite values, and its rows: one
    holding NaN first (a float -inf mask beside it is no bad data by itself)."""
    nan = _batch_nan(step)
    for i, mb in enumerate(step.micro_batches):
        if "inputs" not in mb:
            continue
        args, kwargs = micro_batch_inputs(step, i)
        _, tensors, paths = flatten_tree([list(args), kwargs], "x")
        for key, t in tensors.items():
            soft = nan or _allowed(step, _root_input_name(paths[key]))
            if soft and not (t.is_floating_point() and bool(torch.isnan(t).any())):
                continue
            rows = bad_rows(t)
            if rows:
                return _origin(phase="input", tensor=batch_path(paths[key], len(args)),
                               samples=rows, micro_batch=i, made=_made(t))
        for key, raw in mb.get("loss_paths", {}).items():
            t = step.tensors.get(key)
            if t is not None and bad_rows(t):
                return _origin(phase="input", tensor=loss_path(raw), samples=bad_rows(t),
                               micro_batch=i, made=_made(t))
    ev = step.event
    return _origin(phase="input", tensor=ev.get("tensor"), samples=ev.get("samples", []),
                   micro_batch=ev.get("micro_batch"), made=ev.get("kind"))


def _finish(report, origin, cause, *, reproduced: bool, hint: str | None = None
            ) -> dict[str, Any]:
    if report["event"].get("compiled") and not reproduced:
        report["problems"].append(
            "the event was recorded inside a torch.compile'd module and the replay runs it "
            "eagerly: values only the compiled kernels make (fused arithmetic, inductor's own "
            "dropout random numbers) do not come back; to make dropout replayable, train with "
            "torch._inductor.config.fallback_random = True")
    report["origin"] = origin
    report["cause"] = cause
    report["reproduced"] = reproduced
    report["hint"] = hint or causes.HINTS.get(cause)
    src = origin.get("source")
    if src:
        path, _, line = src.rpartition(":")
        text = linecache.getline(path, int(line)) if line.isdigit() else ""
        report["source_lines"] = {src: text.rstrip()} if text else {}
    return report


# ---------------------------------------------------------------------------------------------
# helpers


def scale_of_the_step(step: Step) -> float | None:
    """The loss scale the event step's backward ran with: the scale the ring recorded after
    the step before (the scaler's update sets the next step's scale), else the step's own,
    with the backoff undone when the scaler skipped it."""
    t, k = step.tensors, step.event.get("step")
    if "ring/scale" not in t or "ring/steps" not in t:
        return None
    steps, scales = t["ring/steps"].tolist(), t["ring/scale"].tolist()
    if k - 1 in steps and math.isfinite(scales[steps.index(k - 1)]):
        return scales[steps.index(k - 1)]
    if k not in steps or not math.isfinite(scales[steps.index(k)]):
        return None
    i = steps.index(k)
    state = (step.meta.get("grad_scaler") or {}).get("state") or {}
    state = dict(state.get("$dict", [])) if isinstance(state, dict) else {}
    backoff = state.get("backoff_factor", 0.5)
    skipped = "ring/skipped" in t and bool(t["ring/skipped"][i])
    return scales[i] / backoff if skipped and backoff else scales[i]


def _log2_ceil(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _matches(step: Step, origin) -> bool:
    ev = step.event
    if ev.get("phase") != "forward":
        return False
    recorded, found = ev.get("module"), origin["module"]
    if ev.get("compiled") and isinstance(recorded, str):  # the origin lies inside the region
        return found == recorded or recorded == "" or found.startswith(recorded + ".")
    return recorded == found


def _find_op_in_call(runner: Runner, module: str, call: int, mb: int) -> OpFinder:
    """Re-run the forward with the op finder active during one module call only."""
    finder = OpFinder()
    state = {"count": 0, "active": False}

    def hooks(model):
        hs = []
        target = model.get_submodule(module) if module else model

        def pre(m, args):
            if runner._mb == mb:
                if state["count"] == call:
                    state["active"] = True
                    finder.__enter__()
                state["count"] += 1

        def post(m, args, out):
            if state["active"]:
                state["active"] = False
                finder.__exit__(None, None, None)
                raise StopRun

        for name, m in model.named_modules():
            if name in runner.allowed:
                hs.append(m.register_forward_pre_hook(lambda *a: _bump(finder, 1)))
                hs.append(m.register_forward_hook(lambda *a: _bump(finder, -1)))
        hs.append(target.register_forward_pre_hook(pre))
        hs.append(target.register_forward_hook(post))
        return hs

    try:
        runner.run(backward=False, instrument=False, hooks=hooks)
    finally:
        if state["active"]:
            finder.__exit__(None, None, None)
    return finder


def _bump(finder: OpFinder, d: int) -> None:
    finder.allowed_depth += d


def _is_batch_dim(step: Step, o) -> bool:
    return bool(o.bad_rows) and o.bad_rows[-1] < _batch_size(step)


def _batch_size(step: Step, i: int = 0) -> int:
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    paths = mb.get("paths", {})
    for key in paths:
        t = step.tensors.get(key)
        if t is not None and t.dim() > 0:
            return int(t.shape[0])
    return 0


def _root_rows(run: Run) -> list[int]:
    return first_bad_rows(t for outs in run.outputs for t in outs)


def _loss_args(step: Step, run: Run, mb: int):
    from .load import loss_inputs

    args, kwargs = loss_inputs(step, mb, [t.detach() for t in run.outputs[mb]])
    return args, kwargs


def _loss_samples(step: Step, run: Run, mb: int) -> list[int]:
    """Rows whose own loss is non-finite (the loss re-run with reduction='none')."""
    fn = step.loss_fn
    if not hasattr(fn, "reduction"):
        return []
    args, kwargs = _loss_args(step, run, mb)
    saved = fn.reduction
    try:
        fn.reduction = "none"
        with torch.no_grad():
            per = fn(*args, **kwargs)
        return bad_rows(per) if isinstance(per, torch.Tensor) and per.dim() else []
    except Exception:
        return []
    finally:
        fn.reduction = saved


def _module_source(step: Step, module: str) -> str | None:
    try:
        m = step.model.get_submodule(module) if module else step.model
        fn = type(m).forward
        path = inspect.getsourcefile(fn)
        _, line = inspect.getsourcelines(fn)
        return f"{os.path.relpath(path)}:{line}" if path else None
    except (TypeError, OSError, AttributeError):
        return user_source([])


def _batch_nan(step: Step) -> bool:
    return any(k.startswith("batch/") and t.is_floating_point() and bool(torch.isnan(t).any())
               for k, t in step.tensors.items())


def _batch_non_finite(step: Step, prefixes, nan_only: bool = False) -> bool:
    """A recorded batch tensor holds NaN (or +-Inf, unless ``nan_only`` or ``allow_inf``
    names the root input it is in)."""
    soft = {k for mb in step.micro_batches for k, raw in mb.get("paths", {}).items()
            if _allowed(step, _root_input_name(raw))}
    return any(k.startswith(prefixes) and not finite(t, allow_inf=nan_only or k in soft)
               for k, t in step.tensors.items())


def _root_input_name(raw: str) -> str:
    """The root input a batch path (into ``[list(args), kwargs]``) lies in, as ``allow_inf``
    names it: ``args[i]`` or the keyword."""
    if raw.startswith("[0]["):
        return f"args[{raw[4:].partition(']')[0]}]"
    if raw.startswith("[1]["):
        key = raw[4:].partition("]")[0]
        return key.strip('"') if key.startswith('"') else key
    return raw


def _non_finite_weights(step: Step) -> list[str]:
    # by the default policy a buffer may hold +-Inf (a causal mask), not NaN
    soft = not step.meta.get("strict_inf", True)
    out = []
    for k, t in step.tensors.items():
        if k.startswith(("weights/", "buffers/")) and not finite(t):
            name = k.split("/", 1)[1]
            if k.startswith("buffers/") and (_allowed(step, name) or finite(t, allow_inf=soft)):
                continue
            out.append(name)
    return out


def _allowed(step: Step, name: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatchcase(name, p) for p in step.meta.get("allow_inf", []))


def _made(t: torch.Tensor) -> str:
    if torch.isnan(t).any():
        return "nan"
    return "+inf" if torch.isposinf(t).any() else "-inf"
