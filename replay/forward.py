"""The origin of a forward event: the module call (bisection, then one probe run that names
the innermost call with finite inputs), the aten op inside that call (the op finder), its rows,
its source line and its cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from typing import Any

from recorder.finite import inf_read_finite
from recorder.scripted import hookable_modules, is_scripted

from .absorbed_log import absorbed_hint
from .attention_logits import attention_logits_hint
from .backward_calls import backward_call_note, run_to_call, user_backward
from .buffer_divisor import buffer_divisor_hint
from .called_at import note_called_at, track_scripted
from .caller_picks import CallerPicks
from .cause import classify
from .cause_result import Cause
from .coincident_points import coincident_hint
from .cumsum_diff import cumsum_diff_hint
from .cumsum_divisor import cumsum_divisor_hint
from .dropped_branch import dropped_branch_hint
from .errors import StopRun
from .exp_overflow import exp_overflow_hint
from .findings import finish, origin_fields
from .forward_grad import derivative_words, with_node
from .group_counts import class_counts_hint
from .held_divisor import held_divisor_hint
from .infinite_statistic import infinite_statistic_hint
from .input_container import written_into_input
from .iteration import line_run
from .kept_divisor import kept_divisor_hint
from .last_update import last_update_text
from .lineage import Lineage
from .literal_fill import nan_given
from .load import Step
from .looked_up import looked_up_hint
from .looked_up_inf import looked_up_inf_hint
from .made_of_params import params_hint
from .masked_product import masked_row_product_hint
from .masked_whole import masked_whole_hint
from .negated_fill import negated, negated_hint
from .never_updated import initial_value_hint
from .offset_divisor import offset_divisor_hint
from .ops import OpFinder
from .other_rows import note_other_rows
from .own_ops import note_inner
from .param_divisor import divisor_hint
from .parametrized import parametrization_hint, parametrization_range_hint, parametrized_advice
from .picked_fill import picked_hint, picked_origin
from .piecewise_forward import forward_piecewise_hint
from .pole_buffers import step_masks
from .product_underflow import lineage_hints
from .pruned import empty_mask_hint, pruned_rows_hint
from .quadratic_form import quadratic_form_hint
from .raw_pole import RawPole, raw_pole_hint
from .recorded import samples
from .recurrence import add_line_note
from .rerun import Runner
from .returned_fill import returned_fill
from .run_result import Run
from .self_edges import self_edge_hint
from .self_pairs import self_pair_hint
from .signed_weights import signed_weights_hint
from .singular_inverse import singular_inverse_hint
from .source import is_torch_file, node_tracebacks, user_source
from .storages import state_of
from .summed_inputs import summed_inputs_note
from .taken_fill import note_taken_fill
from .transforms import outside_transforms
from .zero_id_rows import zero_id_rows_hint
from .zero_param_rows import zero_param_rows_hint
from .zero_state import zero_state_hint


def report_forward(report, step: Step, runner: Runner, run: Run, o) -> dict[str, Any]:
    trigger = run.chain()[1] if not run.strict_inf else None
    # by the default policy a NaN made from NaN-free inputs is searched for as a NaN (not when
    # the chain starts in a call enclosing the NaN's, whose own code made an infinity first)
    nan_only = not run.strict_inf and o.nan and o.inputs_nan_free and trigger is o
    if not o.in_backward:  # (a call the backward made: no forward-only probe reaches it)
        report["bisection"] = _bisect(runner, run, o, nan_only)
    recorded, finder = o, find_op_in_call(runner, o.module, o.call, o.micro_batch)
    # (blamed: a reduction that folded the intended fill into -inf, the NaN's source, over
    # that NaN; an index op that picked a fill's infinity over a NaN the output never held)
    (hit, picked), flipped = picked_origin(finder, finder.blamed(), o.kind), False
    if hit is None and finder.intentional is not None and trigger not in (None, o):
        # the call where the chain seemed to start only filled an intended +-inf (a mask):
        # the event is the NaN made from it later
        start, o = finder.intentional, trigger
        finder = find_op_in_call(runner, o.module, o.call, o.micro_batch)
        finder.intentional = finder.intentional or start
        hit = finder.origin()
    if hit is None and finder.intentional is not None:
        # The only non-finite value is a literal +-inf fill that leaves the module as it is
        # (the one it returned, not a causal mask's that attention consumed before).
        hit = finder.intentional = returned_fill(
            runner, o, finder, lambda where, target: _track_calls(
                where, target, (o.module, o.call), runner, o.micro_batch))
        made = (f"passes on the {hit.made} of buffer '{hit.buffer}'" if hit.buffer else
                f"fills a literal {hit.made}")
        flipped = negated(hit.made, o.kind, run, o.micro_batch)  # (a mask's -inf as +inf)
        report["problems"].append(
            f"{hit.op} {made} that reaches the output of "
            f"'{o.module or '<root>'}'; if that infinity is intended, record with "
            f"FlightRecorder(..., allow_inf=[{o.module!r}])"
            + (" ('' names the root; '*' would allow every module)" if not o.module else "")
            if not flipped else f"{hit.op} fills a literal {hit.made} that reaches the output "
            f"of '{o.module or '<root>'}' as {o.kind}: its sign was flipped after the fill")
    node, o = _node_of(runner, o, hit), _innermost(run, o, hit)
    rows = origin_rows(step, run, o, hit)
    # made: what the blamed op made (the chain's first entry), not what the call returned
    origin = origin_fields(
        phase="forward", module=o.module, call=o.call, micro_batch=o.micro_batch,
        inputs_finite=o.inputs_finite, made=hit.made if hit else o.kind, samples=rows,
        op=hit.op if hit else None,
        source=(hit.source if hit and hit.source else module_source(step, o.module)),
        chain=finder.chain(), input_range=[hit.input_min, hit.input_max] if hit else None,
        dtype=str(hit.evidence.dtype).removeprefix("torch.") if hit and hit.evidence else None)
    note_other_rows(report, step, hit, origin)  # (a support set's, beside the query batch)
    note_called_at(report, runner.model, run, origin, hit, finder.scripted)
    note_taken_fill(report, run, origin)  # (a loss that read a masked -inf score as meant)
    backward_call_note(report, finder, o.module, o.call)  # (an adjoint's reverse solve)
    note_inner(report, hit)  # (the line inside a custom op that made it: replay.own_ops)
    counted = _counted_in(finder, hit, o)
    # (which run of its line, a loop over time steps running it once a step; its values there)
    origin["line_run"], vals, counted = _line_run(runner, o, counted)
    cause = classify(runner, "forward", until=(o.module, o.call, o.micro_batch), hit=counted)
    if flipped or picked:
        cause = Cause("invalid", picked_hint(hit) if picked else negated_hint(hit.op))
    # (the recorder names the chain's start as module statistics show it, ``recorded``, or the
    # event's call: older ones did when a call enclosing it made the infinity its inputs held)
    reproduced = _reproduced(report, step, origin, (recorded, trigger), o, run)
    hint = _hint(step, runner, finder, o, cause, (hit, node), origin, run)
    return add_line_note(finish(report, origin, cause.name, reproduced=reproduced, hint=hint), vals)


def _bisect(runner: Runner, run: Run, o, nan_only: bool) -> dict[str, Any]:
    """At most ceil(log2 calls) bisection runs, then the one run that finds the origin call."""
    n_calls = run.forward_calls()  # those a probe (a forward-only re-run) reaches
    probe_at, probes = runner.bisect(n_calls, nan_only=nan_only)
    agrees = False
    if probe_at is not None:
        found = runner.probe_origin(probe_at, nan_only=nan_only)
        probes += 1
        agrees = found == (o.module, o.call, o.micro_batch)
    return {"probes": probes, "agrees": agrees, "calls": n_calls,
            "limit": _log2_ceil(n_calls) + 1}


def _hint(step: Step, runner: Runner, finder: OpFinder, o, cause, found, origin,
          run: Run) -> str | None:
    """The forward origin's hint: the cause's, with what the op took (a parameter, a table),
    the backward node running it, a raw pole, a log-sum-exp, a log(1 + x) or softplus by
    hand, an inverse of a singular matrix, an exp of a cumulative sum."""
    hit, node = found
    lineage = finder.lineage
    hint = with_node(origin, _with_param(step, runner, finder, o, cause, hit), cause.name, node)
    # (a -inf a table of log frequencies holds at an unseen category, picked by its id)
    hint = looked_up_inf_hint(hint, cause.name, finder.intentional, hit, runner.model,
                              origin) or hint
    hint = raw_pole_hint(lineage and lineage.raw, cause.name, hit) or class_counts_hint(
        lineage and lineage.counts, cause.name, hit) or (
        lineage_hints(hint, cause.name, hit, lineage) if lineage else hint)
    hint = self_pair_hint(hint, cause.name, hit)  # (a distance matrix's diagonal)
    # (a root of x^T M x of an indefinite buffer M: LinUCB's A^-1 a downdate broke)
    hint = quadratic_form_hint(hint, cause.name, hit, lineage and lineage.quadratic,
                               runner.model)
    hint = absorbed_hint(runner, hint, cause.name, hit)  # (log(1 + x) rounded to 0 before)
    # (a padding mask True at every key of the NaN samples: key_padding_mask)
    hint = masked_whole_hint(runner, o, hint, origin.get("samples")) or hint
    hint = masked_row_product_hint(hint, finder, hit)  # (then multiplied by a mask's 0)
    hint = singular_inverse_hint(runner, hint, cause.name, hit)  # (made of a singular's inverse)
    # (an exp's overflow inside a softplus by hand, or of a chunk's exp(-cumsum))
    hint = exp_overflow_hint(runner, hint, cause.name, hit)
    hint = cumsum_diff_hint(runner, hint, cause.name, hit)  # (a cumsum trick's segment sum)
    hint = cumsum_divisor_hint(runner, hint, cause.name, hit)  # (linear attention's z_t)
    # (then in the forces' backward, where the model's output does not hold it)
    hint = dropped_branch_hint(hint, hit, finder.first_nan, run, o, finder.differentiated)
    hint = kept_divisor_hint(hint, finder, hit)  # (whole columns of x / (self.std + eps))
    hint = offset_divisor_hint(hint, cause.name, finder, hit, runner.model)  # (mask + lam)
    hint = self_edge_hint(hint, cause.name, hit, step, o.micro_batch)  # (i == j in edge_index)
    hint = params_hint(hint, hit)  # (log(diag(L)) of a Cholesky factor: which parameters)
    hint = attention_logits_hint(hint, cause.name, origin, step)  # (float16 q @ k.T, then softmax)
    hint = forward_piecewise_hint(runner, o, hit, cause.name, hint, origin)  # (an LNN's relu Hessian)
    return coincident_hint(hint, cause.name, hit, step, o.micro_batch)  # (cdist(a, b) of 0)


def _node_of(runner: Runner, o, hit) -> tuple[str, str | None, str] | None:
    """The backward node ``hit``'s op ran in (a derivative the forward took itself), its
    forward line and what to say of it (:func:`derivative_words`); None for a forward op."""
    if hit is None or hit.node is None or user_backward(hit.node):
        return None
    again = find_op_in_call(runner, o.module, o.call, o.micro_batch, node_tracebacks)
    return derivative_words(hit, again.origin())


def _with_param(step: Step, runner: Runner, finder: OpFinder, o, found, hit) -> str | None:
    """The hint, with the parameter the op took as is named: the fix is then to that
    parameter (bound it, or its learning rate), wherever its values come from; for an op of
    torch's own parametrization (weight_norm) of a layer of zeros, that layer's; for a
    division by the module's own state, all 0 (a power iteration's u), that state's; for a 0
    looked up in a buffer (a word's sampling probability), that table's."""
    hint, cause = found.hint, found.name
    if cause == "invalid" and (
            table := looked_up_hint(hint, runner.model.named_buffers(), finder, hit)):
        return table
    if cause == "invalid" and (
            stat := infinite_statistic_hint(step, runner.model, o.module, hit and hit.op)):
        return stat  # (a running_var an earlier step's outlier overflowed: a fused QAT conv-bn)
    if cause == "invalid" and (knots := buffer_divisor_hint(hint, runner.model, finder, hit)):
        return knots
    if held := held_divisor_hint(hint, cause, finder, hit, runner.model.named_buffers()):
        return held  # (a statistic the model keeps: x / self.std, p / self.p_model)
    if cause == "invalid" and (own := parametrization_hint(step, o.module, hit and hit.op)):
        return own
    if torch_code := parametrization_range_hint(step, o.module, hit and hit.op, hint, cause):
        return torch_code  # (orthogonal's matrix_exp of a huge generator)
    if cause == "invalid" and (rows := pruned_rows_hint(step, o.module, hit and hit.op)):
        return rows  # (structured pruning's zero rows, normalised by the forward)
    if cause == "invalid" and (empty := empty_mask_hint(step, o.module, hit and hit.op)):
        return empty  # (a hand-written mask at 100 % sparsity, the kept weights renormalised)
    if cause == "invalid" and (rows := zero_param_rows_hint(runner.model, o.module, hit)):
        return rows  # (a weight's rows the loop wrote 0, normalised by the forward)
    if cause == "invalid" and (ids := zero_id_rows_hint(step, runner.model, o, hit)):
        return ids  # (a zero padding row looked up by an id, normalised by the forward)
    if cause == "invalid" and (zero := zero_state_hint(runner, o, hit, finder.samples)):
        return zero
    if cause == "invalid" and (signed := signed_weights_hint(runner, o, hit)):
        return signed  # (GDN's gamma learned without its reparameterization)
    return initial_value_hint(step, with_param_advice(hint, cause, hit, step), cause, hit)


def with_param_advice(hint: str | None, cause: str, hit, step: Step | None = None
                      ) -> str | None:
    """``hint`` with what to do about the parameter ``hit``'s op took as is (or an element
    of), if it did: the model's, or one of the loss's the optimizer trains (``<loss>.NAME``);
    with ``step``, and the optimizer's last update that took it out of the op's domain."""
    if hint is None or hit is None or hit.param is None or cause not in PARAM_ADVICE \
            or nan_given(hit):  # (a NaN number beside it: the parameter is not to blame)
        return hint
    if (own := divisor_hint(hint, cause, hit)) is not None:  # (a division by it)
        return own
    ev = hit.evidence
    if cause != "overflow" and ev is not None and ev.elementwise and not any(ev.elementwise):
        return hint  # a matrix's domain (a determinant of 0), not its entries' range
    lo, hi = hit.input_min, hit.input_max
    value = f"{lo:.4g}" if lo == hi else f"in [{lo:.4g}, {hi:.4g}]"
    crossed = last_update_text(step, hit) if step is not None and cause == "invalid" else ""
    advice = parametrized_advice(step, hit.param, cause) \
        or PARAM_ADVICE[cause].format(name=hit.param)  # (one a parametrization takes)
    return f"{hint}; {hit.op}'s input is the parameter {hit.param} ({value}): {advice}{crossed}"


# what to do about a learnable parameter used as is by the op that went non-finite
PARAM_ADVICE = {
    "overflow": "bound it where it is used ({name}.clamp(max=...)) or lower its learning rate",
    "invalid": "keep it in the op's domain by construction (learn its log and use .exp(), or "
               "softplus) or clamp it where it is used",
    "precision": "keep it in the op's domain by construction (learn its log and use .exp(), "
                 "or softplus) or clamp it where it is used",
}


def find_op_in_call(runner: Runner, module: str, call: int, mb: int,
                    forward_ctx=None, passed_kinds: tuple[str, ...] = ()) -> OpFinder:
    """Re-run the forward with the op finder active during one module call only (the run
    inside ``forward_ctx()``, when given), its first op not one that made ``passed_kinds``."""
    finder = OpFinder(samples=samples(runner.step, mb),
                     mask_buffers=step_masks(runner.step, runner.model))
    finder.passed_kinds = passed_kinds
    state, batch = {"count": 0, "active": False}, {}
    # (rows the caller's code picked out of the batch: out[p] = transform(x[p]))
    picks = CallerPicks(finder.samples)

    def hooks(model):
        hs = []
        target = model.get_submodule(module) if module else model
        finder.index_params(model.named_parameters(), model.named_buffers())
        finder.state = state_of(model)

        def pre(m, args):
            if runner.micro_batch == mb:
                if state["count"] == call:
                    state["active"] = True
                    finder.where = (module, call)
                    # (a loss inside the model, torchvision's model(images, targets))
                    finder.lineage = Lineage(finder.samples)
                    finder.lineage.seed_samples(args)
                    finder.lineage.raw = RawPole(batch.get("given"))
                    finder.__enter__()
                    picks.hand_on(args, finder.reordered, finder.moved)
                state["count"] += 1

        def post(m, args, out):
            if state["active"]:
                state["active"] = False
                finder.__exit__(None, None, None)
                raise StopRun

        hs.extend(_allowed_hooks(finder, model, runner.allowed))

        def watch(m, args):  # (from the root call's start to the call's)
            picks.watching = runner.micro_batch == mb and state["count"] <= call

        if target is not model:
            hs.append(model.register_forward_pre_hook(watch, prepend=True))
        # (first of its pre-hooks: those are part of the call, and may make its weights)
        hs.append(target.register_forward_pre_hook(outside_transforms(pre), prepend=True))
        hs.append(target.register_forward_hook(outside_transforms(post)))
        # (the batch as the root call is given it, before the origin's own pre-hook: raw_pole)
        hs.append(model.register_forward_pre_hook(
            lambda m, a, k: batch.update(given=(a, k)), with_kwargs=True, prepend=True))
        return hs + _track_calls(finder, target, (module, call), runner, mb)

    with picks if module else contextlib.nullcontext():  # (outermost: left last)
        run_to_call(runner, finder, state, call, hooks, forward_ctx)
    return finder


def _allowed_hooks(finder: OpFinder, model, allowed) -> list:
    """Hooks keeping ``finder.allowed_depth`` above 0 inside the calls of ``allow_inf``
    modules; '' lets the root's output and own code hold +-inf, not its submodules' (a
    quantizer's log(0) beside wav2vec 2.0's -inf logits)."""
    hs = []
    for name, m in hookable_modules(model):
        if name in allowed:
            hs.append(m.register_forward_pre_hook(lambda *a: _bump(finder, 1)))
            hs.append(m.register_forward_hook(lambda *a: _bump(finder, -1)))
    if "" in allowed:
        for m in model.children():
            if is_scripted(m):
                continue
            hs.append(m.register_forward_pre_hook(lambda *a: _bump(finder, -1)))
            hs.append(m.register_forward_hook(lambda *a: _bump(finder, 1)))
    return hs


def _bump(finder: OpFinder, d: int) -> None:
    finder.allowed_depth += d


def _log2_ceil(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _reproduced(report, step: Step, origin, named: tuple, o, run: Run) -> bool:
    """The re-run's origin is the event's call, the recorded chain's start, its trigger or
    the first call inside the trigger that made one (``named``), or ``o``, inside the event's call, returned the container it was given with
    its output written into it (replay.input_container: said in a note)."""
    recorded, trigger = named
    # (or the first call inside the trigger, where the recorder's chain starts: it reads no
    # call's start, so it passes over an infinity made before the trigger began)
    inner = trigger and run.made_inside(trigger)
    if _matches(step, origin) or any(_matches(step, {"module": c.module})
                                     for c in (recorded, trigger, inner) if c is not None):
        return True
    if note := written_into_input(step, o) or summed_inputs_note(step, origin):
        report["problems"].append(note)  # (the same event, seen closer)
        return True
    return False


def _matches(step: Step, origin) -> bool:
    ev = step.event
    if ev.get("phase") != "forward":
        return False
    recorded, found = ev.get("module"), origin["module"]
    # the origin lies inside the region: a compiled one, or the root whose output alone an
    # evaluation forward checks (a no-grad pass inside the loss: GradCache's embedding pass)
    if (ev.get("compiled") or ev.get("evaluation")) and isinstance(recorded, str):
        return found == recorded or recorded == "" or found.startswith(recorded + ".")
    return recorded == found


def _track_calls(finder: OpFinder, target, home: tuple[str, int], runner: Runner,
                 mb: int) -> list:
    """Hooks keeping ``finder.where`` on the innermost call running now inside ``target``'s
    call ``home`` (its submodules' calls numbered as the instrumented pass numbers calls in
    micro-batch ``mb``; ``home`` itself between them)."""
    seen: dict[str, int] = {}
    stack: list[tuple[str, int]] = []

    def enter(name):
        def pre(m, args):
            if runner.micro_batch == mb:
                k = seen.get(name, 0)
                seen[name] = k + 1
                stack.append((name, k))
                finder.where = stack[-1]
                finder.entered[stack[-1]] = dict(finder.counts)
        return pre

    def leave(m, args, out):
        if runner.micro_batch == mb and stack:
            stack.pop()
            finder.where = stack[-1] if stack else home

    hs = []
    for name, m in hookable_modules(target, prefix=home[0]):
        if m is not target:
            # (first: a forward pre-hook of its own, the user's or torch's, runs in its call)
            hs.append(m.register_forward_pre_hook(outside_transforms(enter(name)),
                                                  prepend=True))
            hs.append(m.register_forward_hook(outside_transforms(leave)))
    return hs + track_scripted(finder, target, home[0], lambda: runner.micro_batch == mb)


def _innermost(run: Run, o, hit):
    """The call inside ``o`` whose own code ran the blamed op: module statistics stop at a
    call whose inputs held an infinity (``nn.TransformerEncoder`` gives each attention its
    padding mask as -inf, so an overflow in one is first seen as the encoder's), the op
    finder does not."""
    if hit is None or hit.within is None or hit.within[0] == o.module:
        return o
    name, k = hit.within
    return next((c for c in run.calls
                 if (c.module, c.call, c.micro_batch) == (name, k, o.micro_batch)), o)


def _line_run(runner: Runner, o, hit):
    """:func:`line_run`, and ``hit`` without its op's earlier calls' sizes when each run of
    its line took parameters of its own: a stack of layers, whose calls are no iterates."""
    run, vals, stack = line_run(runner, o.module, o.call, o.micro_batch, hit)
    if stack and hit.evidence is not None:
        hit = dataclasses.replace(hit, evidence=dataclasses.replace(hit.evidence, sizes=[]))
    return run, vals, hit


def _counted_in(finder: OpFinder, hit, o):
    """``hit`` with its occurrence counted from the start of call ``o``, where the float64
    re-run captures it, not from the start of the enclosing call the finder watched (an MoE
    layer's 0/0 in a side value, an aux loss, that only the root's output carries)."""
    before = finder.entered.get((o.module, o.call))
    if hit is None or before is None:
        return hit
    name = hit.op.partition(".")[2] or hit.op  # (mylib.fused_norm's own namespace too)
    return dataclasses.replace(hit, occurrence=hit.occurrence - before.get(name, 0))


def origin_rows(step: Step, run: Run, o, hit) -> list[int]:
    """The samples of a forward origin: of the blamed op's output when they are among the
    call's non-finite samples (a module whose own code made the NaN in one row, then ran a
    child that mixes rows, BatchNorm or attention over the batch, returns it in every row),
    else of the call's first non-finite output when it has the batch's samples, else of the
    op's (the root's own code computing a loss in the model, whose output is then 0-d), else
    of the model output."""
    op_rows = hit.rows if hit and hit.rows else []
    if op_rows and set(op_rows) <= set(o.bad_rows):
        return op_rows
    return o.bad_rows or op_rows or _root_rows(step, run)


def _root_rows(step: Step, run: Run) -> list[int]:
    """(the NaN rows only where allow_inf lets the root's output hold +-inf: wav2vec 2.0's
    -inf logits are no samples of a NaN the quantizer made of the whole batch's counts)"""
    keep = inf_read_finite if "" in run.allowed else (lambda outs: outs)
    return next((rows for mb, outs in enumerate(run.outputs)
                 if (rows := samples(step, mb).first_rows(keep(outs), stacked=True))), [])


def module_source(step: Step, module: str) -> str | None:
    try:
        m = step.model.get_submodule(module) if module else step.model
        fn = type(m).forward
        path = inspect.getsourcefile(fn)
        if path is None or is_torch_file(path):  # (torch's nn.Linear: no line of the user's)
            return None
        _, line = inspect.getsourcelines(fn)
        return f"{os.path.relpath(path)}:{line}"
    except (TypeError, OSError, AttributeError):
        return user_source([])
