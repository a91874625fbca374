"""What the bundle itself says, before anything is re-run: the batch size, non-finite batch
tensors and weights (under the recording's +-Inf policy and ``allow_inf``), the input origin,
and the loss scale the event step ran with.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from recorder.batch_tensors import record_rows
from recorder.capture import batch_path, flatten_tree, loss_path, tree_refs
from recorder.finite import bad_rows, finite, has_nan, kind_of, matches
from recorder.missing import allow_nan_advice, root_input_name
from recorder.samples import (
    Record,
    Samples,
    assignment,
    broadcast_fields,
    infer,
    packed_in,
    recurrent,
    seq_first,
)
from recorder.target_inputs import input_targets

from .env_observations import env_observation_hint
from .findings import origin_fields
from .group_nan import group_nan
from .grouped_rows import grouped, grouped_hint
from .infinite_entries import infinite_entries_hint
from .input_text import (
    ALLOWED_NAN_LEAKED,
    LOSS_ARGUMENT,
    LOSS_ARGUMENT_EVERY,
    SHARED_INPUT,
    SHARED_ROWS,
    WHOLE_COLUMNS,
    WHOLE_TENSOR,
    evaluating,
)
from .laundered_nan import laundered_hint
from .load import Step, micro_batch_inputs
from .loss_arg_name import forward_param_name, with_param_name
from .masked_gaps import masked_gaps
from .missing_entries import missing_entries
from .nan_runs import NAN_RUNS, nan_runs
from .padded_elements import padded_elements
from .repeated_record import repeated_record
from .shared_loss_arg import shared_loss_arg_hint
from .unmarked_missing import scattered_missing
from .whole_slices import slices_hint, whole_slices

# a loss argument (a target) NaN/Inf in the same features of every sample, the model's
# inputs finite (see replay.cause_text's WHOLE_COLUMNS for a batch tensor)
LOSS_ARGUMENT_COLUMNS = (
    "{tensor} is an argument of the loss, not data the model took (its inputs were finite), "
    "and holds {kind} in the same feature(s) of every sample ({cols}) and nowhere else: not a "
    "bad record but a per-feature step that made the targets, run on every sample alike (a "
    "standardisation by statistics fitted on the training set whose std is 0 there, a value "
    "every sample shares: a Dirichlet boundary held at 0, a constant channel; add an eps to "
    "the std, or leave those features out of the standardisation and the loss; statistics "
    "fitted on a split holding a NaN there: fit them with nanmean/nanstd); if the loop "
    "computes it, that code made the {kind}")

_KINDS = {"nan": "NaN", "+inf": "+Inf", "-inf": "-Inf"}


def samples(step: Step, i: int = 0) -> Samples:
    """Where micro-batch ``i``'s tensors hold their samples (see :mod:`recorder.samples`)."""
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    found = entry_samples(mb, step.tensors, step.model)
    ev = step.event
    if ev.get("phase") == "forward" and ev.get("micro_batch") == i and ev.get("samples"):
        # (the recorder's rows of the root outputs: see Samples.seen)
        return replace(found, seen=frozenset(ev["samples"]))
    return found


def entry_samples(mb: dict[str, Any], tensors: dict[str, torch.Tensor], model) -> Samples:
    """The samples of a bundle's micro-batch entry: as the recorder found them, with the live
    outputs (``samples``), else (an older bundle, a rewind step) from its inputs, loss targets
    and recorded output gradients."""
    kept = mb.get("samples")
    size = kept.get("size") if isinstance(kept, dict) else None
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return Samples(size, kept.get("seq_first") is True,
                       kept.get("recurrent", recurrent(model)) is True,
                       assignment(tensors[k] for k in tree_refs(mb.get("inputs"), "$t")
                                  if isinstance(tensors.get(k), torch.Tensor)))

    def present(keys) -> list[torch.Tensor]:
        return [t for k in keys if isinstance(t := tensors.get(k), torch.Tensor)]

    return infer(present(mb.get("paths", {})),
                 present([*mb.get("loss_paths", {}), *mb.get("output_grads", {}).values()]),
                 seq_first(model), recurrent(model))


def batch_size(step: Step, i: int = 0) -> int:
    return samples(step, i).size


def whole_batch(origin: dict[str, Any]) -> bool:
    """The origin's samples are every row of its micro-batch (``all_samples``: the text
    report prints ``all N rows``)."""
    n = origin.get("batch_size")
    return bool(n) and origin.get("samples") == list(range(n))


def _batch_nan(step: Step, last: int) -> bool:
    keys = {k for i, mb in enumerate(step.micro_batches[:last + 1]) if _as_run(step, i)
            for k in mb.get("paths", {})}
    return any(has_nan(step.tensors[k]) for k in keys if k in step.tensors)


def _as_run(step: Step, i: int) -> bool:
    """Whether the bundle holds micro-batch ``i``'s inputs as its forward took them: not one
    whose tensor the next forward took again (``taken_again``: a sampler stepping it through
    .data, bundled as its last write left it), unless it is the event's own; nor one whose
    forward raised and which the loop skipped (``abandoned``: see recorder.abandoned)."""
    mb = step.micro_batches[i]
    return not mb.get("abandoned") and (not mb.get("taken_again")
                                        or i == step.event.get("micro_batch"))


def _event_micro_batch(step: Step) -> int:
    """The last micro-batch an input origin may be in: that of an input, forward or loss
    event (the later ones ran after it, made from it: a sampler's chain whose +inf turned
    into NaN the step after, or that carried the NaN its forward made), else the step's last."""
    i = step.event.get("micro_batch")
    n = len(step.micro_batches)
    return i if step.event.get("phase") in ("input", "forward", "loss") \
        and isinstance(i, int) and i < n else n - 1


def stepped_after_forward(step: Step) -> int | None:
    """The micro-batch of a forward or loss event whose input tensor the next forward took
    itself (``taken_again``) and which the bundle holds with NaN, where the recorder's check
    found none: the loop wrote into it after the forward (a sampler's in-place step, carrying
    on the NaN the forward made); None otherwise."""
    i = step.event.get("micro_batch")
    if step.event.get("phase") not in ("forward", "loss") or not isinstance(i, int) \
            or i >= len(step.micro_batches) or not step.micro_batches[i].get("taken_again"):
        return None
    held = [step.tensors.get(k) for k in step.micro_batches[i].get("paths", {})]
    return i if any(isinstance(t, torch.Tensor) and has_nan(t) for t in held) else None


def _micro_batch_of(key: str) -> int:
    """The micro-batch of a ``batch/<i>/...`` or ``loss_in/<i>/...`` key (-1: none)."""
    part = key.split("/")[1] if key.count("/") else ""
    return int(part) if part.isdigit() else -1


def batch_non_finite(step: Step, prefixes, nan_only: bool = False) -> bool:
    """A recorded batch tensor holds NaN (or +-Inf, unless ``nan_only`` or ``allow_inf``
    names the root input it is in), outside the root inputs ``allow_nan`` names (missing
    values the model imputes: their NaN is bad data only where it leads), in the micro-batches
    up to an input, forward or loss event's own (see :func:`_event_micro_batch`)."""
    paths = {k: root_input_name(raw) for mb in step.micro_batches
             for k, raw in mb.get("paths", {}).items()}
    soft = {k for k, name in paths.items() if _allowed(step, name)}
    missing = {k for k, name in paths.items() if nan_allowed(step, name)}
    last = _event_micro_batch(step)
    return any(k.startswith(prefixes) and k not in missing and _micro_batch_of(k) <= last
               and (_micro_batch_of(k) < 0 or _as_run(step, _micro_batch_of(k)))
               and not finite(t, allow_inf=nan_only or k in soft)
               for k, t in step.tensors.items())


def allowed_nan_held(step: Step) -> bool:
    """A recorded batch tensor of a root input that ``allow_nan`` names holds NaN (a missing
    value the model was to impute), which :func:`batch_non_finite` leaves out."""
    paths = {k: root_input_name(raw) for mb in step.micro_batches
             for k, raw in mb.get("paths", {}).items()}
    return any(nan_allowed(step, name) and has_nan(t) for k, name in paths.items()
               if isinstance(t := step.tensors.get(k), torch.Tensor))


def nan_allowed(step: Step, name: str) -> bool:
    """Root input ``name`` may hold NaN (``allow_nan``)."""
    return matches(name, step.meta.get("allow_nan", []))


def non_finite_weights(step: Step) -> list[str]:
    """The parameters holding NaN/Inf and the buffers holding NaN as the step began. A buffer
    may hold +-Inf (a causal mask) under either infinity policy: the recorder checks no buffer,
    and under ``strict_inf`` the -inf is an event where it reaches a module's output, which
    the re-run then names (blaming the mask as weights written outside the optimizer sent
    users to their checkpoints). So may a frozen parameter the recorder found all ±inf at
    attach (``inf_constants``: a mask value kept as a parameter, see recorder.constants)."""
    out, constants = [], set(step.meta.get("inf_constants") or ())
    for k, t in step.tensors.items():
        if k.startswith(("weights/", "buffers/")) and not finite(t):
            name = k.split("/", 1)[1]
            if (k.startswith("buffers/") or name in constants) and finite(t, allow_inf=True):
                continue
            out.append(name)
    return out


def _allowed(step: Step, name: str) -> bool:
    return matches(name, step.meta.get("allow_inf", []))


def input_origin(step: Step) -> dict[str, Any]:
    """The batch tensor (or loss target) holding the non-finite values, and its rows: one
    holding NaN first (a float -inf mask beside it is no bad data by itself); a positional
    model input with the name the model's ``forward`` gives it (``arg``)."""
    o = _input_origin(step)
    if named := forward_param_name(o.get("tensor"), step.model):
        o["arg"] = named
    return o


def _input_origin(step: Step) -> dict[str, Any]:
    last = _event_micro_batch(step)
    nan = _batch_nan(step, last)
    named = step.event.get("tensor") if step.event.get("phase") == "input" else None
    for i, mb in enumerate(step.micro_batches[:last + 1]):
        if "inputs" not in mb or not _as_run(step, i):
            continue
        args, kwargs = micro_batch_inputs(step, i)
        _, tensors, paths = flatten_tree([list(args), kwargs], "x")
        rows = samples(step, i).rows
        packed = packed_in([args, kwargs], input_targets(args, kwargs, step.model))
        for key, t in tensors.items():
            soft = nan or _allowed(step, root_input_name(paths[key]))
            if soft and not has_nan(t):
                continue
            if not finite(t):
                name = batch_path(paths[key], len(args))
                bad = rows(t, packed)  # (those of an allow_nan input that the event saw get by)
                if isinstance(rec := packed.get(id(t)), Record):  # (a list of per-sample entries)
                    bad = record_rows(tensors.values(), packed, samples(step, i), rec.of, bad)
                missing = nan_allowed(step, root_input_name(paths[key]))
                if missing and named and name != named and not bool(torch.isinf(t).any()):
                    continue  # missing values the model imputes; the event named another
                if missing and name == named:
                    bad = [r for r in bad if r in step.event.get("samples", [])] or bad
                group = None if bad else grouped(t, samples(step, i).size)  # (a pair's)
                o = origin_fields(phase="input", tensor=name, samples=bad or (
                    group or {}).get("samples", []), micro_batch=i, made=kind_of(t))
                return {**o, "grouped": group} if group else o
        # the loss argument the recorder named first: it skipped those computed from the
        # model output (out * w, not data), which the bundle keeps as tensors like targets
        for key, raw in sorted(mb.get("loss_paths", {}).items(),
                               key=lambda kv: loss_path(kv[1]) != named):
            t = step.tensors.get(key)
            if t is not None and not finite(t):
                # (the recorder saw the structure the bundle flattens: a target dict of a
                # list of one per image, whose boxes have no batch dimension)
                seen = step.event.get("samples", []) if loss_path(raw) == named else []
                return origin_fields(phase="input", tensor=loss_path(raw),
                                     samples=rows(t) or seen, micro_batch=i, made=kind_of(t))
    ev = step.event
    return origin_fields(phase="input", tensor=ev.get("tensor"), samples=ev.get("samples", []),
                         micro_batch=ev.get("micro_batch"), made=ev.get("kind"))


def input_hint(origin: dict[str, Any], step: Step) -> str | None:
    """The hint of an input event on a loss argument while every batch tensor is finite (a
    teacher's output, which the loop computed: no data need be bad), or on a tensor without
    sample rows (an attention mask of shape (T, T) passed to forward); None for one that
    names samples (the data pipeline's hint)."""
    tensor = origin.get("tensor") or ""
    if handled := step.event.get("nan_handled"):  # (or fake quantization rounded it)
        return laundered_hint(step.model, handled) or allow_nan_advice(handled)
    key, raw = origin_key(step, origin)
    if nan_allowed(step, root_input_name(raw)):
        return ALLOWED_NAN_LEAKED.format(tensor=tensor)
    if key and (env := env_observation_hint(  # (an SB3 env's observations)
            step, step.tensors.get(key), origin.get("made"), tensor)):
        return env
    if g := origin.get("grouped"):  # (one row per preference pair)
        return grouped_hint(tensor, g, batch_size(step, origin.get("micro_batch") or 0))
    if whole := _whole_tensor(step, origin, key):
        return WHOLE_TENSOR.format(tensor=tensor, kind=whole, evaluating=evaluating(step.event))
    if cols := _whole_columns(step, origin, key):
        return WHOLE_COLUMNS.format(tensor=tensor, cols=cols)
    if key and (gaps := masked_gaps(step.tensors.get(key), tensor, _named_batch(step, origin))):
        return gaps
    if key and (where := whole_slices(step.tensors.get(key), _sample_dim(step, origin, key))):
        sets = _sample_dim(step, origin, key) == 0  # (samples, elements, features...)
        return sets and padded_elements(step.tensors.get(key), where, tensor, _named_batch(
            step, origin)) or slices_hint(step.tensors[key], _sample_dim(step, origin, key),
                                          tensor, where)
    if key and (where := nan_runs(step.tensors.get(key), _sample_dim(step, origin, key))):
        return NAN_RUNS.format(tensor=tensor, where=where)
    if tensor.startswith("loss_") and not batch_non_finite(step, ("batch/",)):
        where = samples(step, origin.get("micro_batch") or 0)
        if shared := shared_loss_arg_hint(step, origin, where):  # (class weights, no rows)
            return shared
        kind = _KINDS.get(origin.get("made"), "NaN/Inf")
        if cols := _whole_columns(step, origin, input_key(step, origin), partial=True):
            return LOSS_ARGUMENT_COLUMNS.format(tensor=with_param_name(tensor, step.loss_fn),
                                                kind=kind, cols=cols)
        rows, n = origin.get("samples") or [], batch_size(step, origin.get("micro_batch") or 0)
        every = LOSS_ARGUMENT_EVERY.format(kind=kind) if n and rows == list(range(n)) else ""
        return LOSS_ARGUMENT.format(tensor=with_param_name(tensor, step.loss_fn), every=every,
                                    kind=kind)
    if key and origin.get("samples") and (copies := repeated_record(  # (a sampler's repeats)
            step.tensors.get(key), _sample_dim(step, origin, key), _KINDS.get(
                origin.get("made"), "NaN/Inf"))):
        return copies.format(tensor=tensor)
    if key and origin.get("samples") and (group := group_nan(
            step.tensors.get(key), _sample_dim(step, origin, key), _KINDS.get(
                origin.get("made"), "NaN/Inf"))):
        return group.format(tensor=tensor)
    if key and origin.get("samples") and (where := missing_entries(  # (per sample: no field)
            step.tensors.get(key), _sample_dim(step, origin, key))):
        return scattered_missing(step.tensors[key], tensor, _named_batch(step, origin), where)
    if key and origin.get("samples") and (inf := infinite_entries_hint(  # (a ratio's x / 0,
            step.tensors.get(key), _sample_dim(step, origin, key), tensor)):  # a rank-gauss)
        return inf
    if origin.get("samples") or not tensor:
        return None
    return SHARED_INPUT.format(tensor=f"the input {tensor}") + _some_rows(
        step, key, origin.get("micro_batch") or 0)


def _some_rows(step: Step, key: str, i: int) -> str:
    """Where a batch tensor without the batch's samples holds its non-finite values, when only
    in some rows of its dim 0 (records of their own: a support set beside the query batch);
    none for one field broadcast over the samples (a land-sea mask: its rows are latitudes)."""
    t = step.tensors.get(key)
    if t is None or not t.is_floating_point() or t.dim() < 1 or t.shape[0] < 2:
        return ""
    given = [step.tensors.get(k) for k in step.micro_batches[i].get("paths", {})]
    if any(f is t for f in broadcast_fields([u for u in given if isinstance(u, torch.Tensor)])):
        return ""
    rows = bad_rows(t, 0)
    return SHARED_ROWS.format(rows=rows, n=t.shape[0]) if 0 < len(rows) < t.shape[0] else ""


def origin_key(step: Step, origin: dict[str, Any]) -> tuple[str, str]:
    """The bundle key and the raw path of the batch tensor an input origin names ("" when it
    names none, or a loss argument)."""
    mb = step.micro_batches[origin.get("micro_batch") or 0] if step.micro_batches else {}
    n_args = len(micro_batch_inputs(step, origin.get("micro_batch") or 0)[0]) \
        if "inputs" in mb else 1
    for key, raw in mb.get("paths", {}).items():
        if batch_path(raw, n_args) == origin.get("tensor"):
            return key, raw
    return "", ""


def input_key(step: Step, origin: dict[str, Any]) -> str:
    """The bundle key of the tensor an input origin names: a batch tensor or a loss argument
    ("" for none)."""
    key, _ = origin_key(step, origin)
    if key:
        return key
    i = origin.get("micro_batch") or 0
    mb = step.micro_batches[i] if i < len(step.micro_batches) else {}
    return next((k for k, raw in mb.get("loss_paths", {}).items()
                 if loss_path(raw) == origin.get("tensor")), "")


def _named_batch(step: Step, origin: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch's tensors by the names the report gives them (``args[2]``)."""
    i = origin.get("micro_batch") or 0
    mb = step.micro_batches[i] if step.micro_batches else {}
    n = len(micro_batch_inputs(step, i)[0]) if "inputs" in mb else 1
    return {batch_path(raw, n): step.tensors.get(key) for key, raw in mb.get("paths", {}).items()}


def _whole_tensor(step: Step, origin: dict[str, Any], key: str) -> str:
    """``"NaN"``, ``"+Inf"``, ``"-Inf"``... when every value of the batch tensor ``key``, of
    more than one sample, is non-finite, else "" (one that is not per sample: SHARED_INPUT)."""
    t = step.tensors.get(key)
    d = samples(step, origin.get("micro_batch") or 0).dim(t) if t is not None else None
    if d is None or t.shape[d] < 2 or not t.is_floating_point() or torch.isfinite(t).any():
        return ""
    kinds = {k for k, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf),
                            ("-Inf", torch.isneginf)) if f(t).any()}
    if kinds == {"+Inf", "-Inf"}:
        return "+Inf or -Inf"
    return kinds.pop() if len(kinds) == 1 else "NaN/Inf"


def _sample_dim(step: Step, origin: dict[str, Any], key: str) -> int | None:
    t = step.tensors.get(key)
    return None if t is None else samples(step, origin.get("micro_batch") or 0).dim(t)


def _whole_columns(step: Step, origin: dict[str, Any], key: str, partial: bool = False
                   ) -> str:
    """The features (positions past the sample dimension: columns, or index lists for more
    dims) non-finite in every sample of the batch tensor ``key``, as text ("" when none): a
    whole column, which a per-feature step of the pipeline made (a standardisation by a zero
    std), not a record. ``partial``: only when those features hold every non-finite value and
    some feature is finite (a loss argument, which the loop may have made whole)."""
    t = step.tensors.get(key) if key else None
    d = samples(step, origin.get("micro_batch") or 0).dim(t) if t is not None else None
    if d is None or t.dim() < 2 or t.shape[d] < 2 or not t.is_floating_point():
        return ""
    bad = ~torch.isfinite(t.detach().movedim(d, 0).reshape(t.shape[d], -1))
    whole = bad.all(0)
    cols = whole.nonzero().flatten()
    if not cols.numel() or partial and (bool(whole.all()) or bool(bad[:, ~whole].any())):
        return ""
    more = f" (+{cols.numel() - 8})" if cols.numel() > 8 else ""
    rest = [n for j, n in enumerate(t.shape) if j != d]
    if len(rest) < 2:
        return f"column(s) {', '.join(map(str, cols[:8].tolist()))}{more}, counted past the " \
            "sample dimension"
    # (a field's flat index says nothing: SST NaN over land is channel 1 at the land cells)
    at = torch.stack(torch.unravel_index(cols, rest), dim=1)
    dims = [j for j in range(t.dim()) if j != d]
    shared = [j for j in range(len(rest))
              if cols.numel() > 1 and bool((at[:, j] == at[0, j]).all())]
    same = [f"index {int(at[0, j])} of dim {dims[j]}" for j in shared]
    # (every position of that index: a whole channel or variable, not a region of a field)
    entire = len(shared) == 1 and cols.numel() == math.prod(rest) // rest[shared[0]]
    return (f"position(s) {', '.join(str(p) for p in at[:8].tolist())}{more} of each "
            f"sample's {tuple(rest)}" + (f", all at {' and '.join(same)}" if same else "")
            + (f", every one of its {cols.numel()} positions (a whole channel or variable)"
               if entire else ""))


def scaler_state(step: Step) -> dict[str, Any]:
    """The GradScaler's state the bundle holds (``scale``, ``backoff_factor``, ...), {} when
    it holds none."""
    state = (step.meta.get("grad_scaler") or {}).get("state") or {}
    pairs = state.get("$dict", []) if isinstance(state, dict) else []
    return {kv[0]: kv[1] for kv in pairs if len(kv) == 2 and isinstance(kv[0], str)}


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
    backoff = scaler_state(step).get("backoff_factor", 0.5)
    skipped = "ring/skipped" in t and bool(t["ring/skipped"][i])
    return scales[i] / backoff if skipped and backoff else scales[i]


def n_args(tree: Any) -> int:
    """How many positional arguments the recorded root call had (``batch`` when one)."""
    try:
        return len(tree["$list"][0]["$list"])
    except (KeyError, IndexError, TypeError):
        return 1
