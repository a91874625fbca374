"""Samples whose recorded data is out of scale with the rest of the batch: a record in the wrong
unit (a label of 1e30 from a bad conversion, an audio clip whose gain was never normalised)
makes an overflow that no wider type or rescaling of the op fixes; dropping those samples, and
fixing the data, does.

Both the model's inputs (``batch/``) and the loss's other arguments (``loss_in/``: targets,
weights) are searched, along the batch dimension each tensor has.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from recorder.capture import batch_path, loss_path
from recorder.finite import zero_one
from recorder.loss_forwards import ran_in_loss
from recorder.missing import root_input_name

from .carried_state import carried_keys
from .domains import g
from .load import Step
from .recorded import n_args, nan_allowed, samples
from .unread_data import loss_only_keys

FACTOR = 10.0  # the named rows' largest magnitude against every other row's
_LARGEST = torch.finfo(torch.float64).max


def outlier_input(step: Step, mb: int, rows: list[int], factor: float = FACTOR,
                  skip: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The first floating tensor of micro-batch ``mb`` (model inputs, then loss arguments)
    whose largest magnitude in ``rows`` is ``factor`` times that of every other row:
    ``{"tensor": its readable name, "value": that magnitude, "others": the other rows'}``;
    None when there is none (or ``rows`` is empty or more than half the batch: records out of
    scale are the few, and where most rows stand above the rest it is the rest that are small,
    as the points of a grid near its 0)."""
    if not rows:
        return None
    for key, name, per in _row_magnitudes(step, mb, skip):
        if max(rows) >= len(per) or not _few(rows, per):
            continue
        mask = torch.zeros(len(per), dtype=torch.bool)
        mask[rows] = True
        top, others = float(per[mask].max()), float(per[~mask].max())
        # (a non-finite value has no scale: a loss argument the loop made of an earlier
        # forward's -inf, a behaviour policy's log-probability of 0, is no record in a wrong unit)
        if _finite(top) and top > factor * others:
            return {"tensor": name, "value": top, "others": others, "key": key,
                    "fill": fill_value(step, mb, key, rows)}
    return None


def _finite(magnitude: float) -> bool:
    """Whether a row's magnitude (:func:`_row_magnitudes`: NaN as +Inf, an infinity as the
    largest float64 by ``nan_to_num``) is a finite value's."""
    return magnitude < _LARGEST


def _few(rows: list[int], per: torch.Tensor) -> bool:
    """Whether ``rows`` are at most half of the ``len(per)`` rows (:func:`outlier_rows`'s
    bound): a majority standing apart from a minority is no set of outlying records."""
    return 2 * len(rows) <= len(per)


def fill_value(step: Step, mb: int, key: str, rows: list[int]) -> float | None:
    """The one value every entry of ``rows`` of the tensor ``key`` holds, where each row holds
    more than one (a nodata code filling a whole record: a raster's -9999 in every band);
    else None."""
    for k, _, _, v in row_values(step, mb):
        if k == key:
            sel = v[rows]
            if sel.shape[1] > 1 and bool((sel == sel[0, 0]).all()):
                return float(sel[0, 0])
    return None


def undersized_input(step: Step, mb: int, rows: list[int], factor: float = FACTOR
                     ) -> dict[str, Any] | None:
    """An underflow's converse of :func:`outlier_input`: the first floating tensor whose
    largest magnitude in ``rows`` is nonzero and ``factor`` times below that of every other
    row (a record in volts among records in microvolts), described alike; None if none.
    A tensor of one value per sample is a condition, not a record (an SNR's noise variance
    ``10 ** (-snr_db / 10)``, a diffusion sigma): spanning decades is its design."""
    if not rows:
        return None
    for key, name, per in _row_magnitudes(step, mb):
        if max(rows) >= len(per) or not _few(rows, per) or (
                step.tensors[key].numel() == len(per)):
            continue
        mask = torch.zeros(len(per), dtype=torch.bool)
        mask[rows] = True
        top, others = float(per[mask].max()), float(per[~mask].min())
        if 0 < top and factor * top < others < math.inf:
            return {"tensor": name, "value": top, "others": others, "key": key}
    return None


def outlier_rows(step: Step, mb: int, factor: float = FACTOR,
                 skip: frozenset[str] = frozenset()) -> tuple[list[int], dict[str, Any]] | None:
    """For an overflow whose non-finite values span the whole batch (a BatchNorm, a batch
    mean, a similarity over every pair: the op mixes the samples), the few rows (at most half)
    of the first floating tensor whose magnitudes stand ``factor`` times above every other
    row's, at the widest such gap, with :func:`outlier_input`'s description; None if none."""
    for key, name, per in _row_magnitudes(step, mb, skip):
        order = torch.argsort(per, descending=True, stable=True)
        ranked = per[order]
        if not _finite(float(ranked[0])):  # (non-finite values: no scale, see outlier_input)
            continue
        # (rows of 0 under rows of 0 stand above nothing: a sparse task's rewards all 0)
        gaps = [(float(ranked[k - 1] / ranked[k]) if ranked[k] > 0 else math.inf, k)
                for k in range(1, len(per) // 2 + 1)
                if math.isfinite(ranked[k]) and ranked[k - 1] > 0]
        ratio, k = max(gaps, default=(0.0, 0))
        if ratio > factor:
            return sorted(order[:k].tolist()), {"tensor": name, "value": float(ranked[0]),
                                                "others": float(ranked[k]), "key": key}
    return None


def _row_magnitudes(step: Step, mb: int, skip: frozenset[str] = frozenset()):
    """(bundle key, readable name, each sample's largest magnitude, NaN as +Inf) of the
    floating tensors of micro-batch ``mb`` that have a sample dimension, but those in
    ``skip`` and those of 0/1 values alone (:func:`_binary`): model inputs, then loss
    arguments."""
    where = samples(step, mb) if mb < len(step.micro_batches) else None
    for key, name, missing, a in row_values(step, mb, skip):
        if _binary(a):
            continue
        a = a.abs()
        per = torch.nan_to_num((torch.nan_to_num(a, nan=0.0) if missing else a).amax(1),
                               nan=math.inf)
        # (a row per node of a graph batch: each graph's largest)
        if where.per_node(step.tensors[key]):
            ids = where.segments.ids.to(per.device)
            per = per.new_zeros(where.size).scatter_reduce(0, ids, per, "amax")
        yield key, name, per


def _binary(a: torch.Tensor) -> bool:
    """Whether every value of ``a`` is 0 or 1 (NaN aside): a label, a mask, an indicator (a
    stay's mortality, the one death of the batch): its values are classes, not magnitudes, so
    a row of 1 among rows of 0 is no record out of scale."""
    a = a[~a.isnan()]
    return zero_one(a)


def row_values(step: Step, mb: int, skip: frozenset[str] = frozenset()):
    """(bundle key, readable name, whether its NaN are missing values, its values as float64
    with a row per sample dimension entry, ``(rows, -1)``) of the floating tensors of
    micro-batch ``mb`` that have a sample dimension, but those in ``skip``: model inputs, then
    loss arguments. A graph batch's tensors have a row per node."""
    if mb >= len(step.micro_batches):
        return
    entry, where = step.micro_batches[mb], samples(step, mb)
    count = n_args(entry.get("inputs"))
    # (an allow_nan input's NaN is a missing value, of no magnitude: as +Inf, every row
    # missing one would stand above an out-of-scale record)
    # (not the inputs of a call of the model the loss made itself, DRAGAN's perturbed reals:
    # values the loss made, no data; the loss's own arguments are)
    inputs = {} if ran_in_loss(step.micro_batches, step.meta.get("loss"), mb) \
        else entry.get("paths") or {}
    named = [(k, batch_path(raw, count), nan_allowed(step, root_input_name(raw)))
             for k, raw in inputs.items()]
    # (not a loss argument the loop made of the model output, q.log(): it is no data)
    made = set(entry.get("loss_grad_args") or ())
    named += [(k, loss_path(raw), False) for k, raw in (entry.get("loss_paths") or {}).items()
              if k not in made]
    for key, name, missing in named:
        t = None if key in skip else step.tensors.get(key)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
            continue
        d = 0 if where.per_node(t) else where.dim(t)
        if d is not None and t.shape[d] > 1:
            yield key, name, missing, t.detach().movedim(d, 0).reshape(t.shape[d], -1).double()


def out_of_scale(step: Step, origin: dict[str, Any]
                 ) -> tuple[list[int], dict[str, Any]] | None:
    """(rows, description) of an overflow origin's out-of-scale samples: its own samples when
    their data stands out (:func:`outlier_input`), or, when its non-finite values span the
    whole batch (an op that mixes the samples), the few rows that do (:func:`outlier_rows`)."""
    unread = loss_only_keys(step, origin)  # (targets a forward origin's op never took)
    found = _out_of_scale(step, origin, unread)
    if found is None or found[1]["key"] not in (step.micro_batches[
            origin.get("micro_batch") or 0].get("paths") or {}):
        return found
    # (a model input: a state the model returned in the step before is no data; the forward
    # re-run that tells is made only here)
    skip = frozenset(carried_keys(step, origin.get("micro_batch") or 0))
    return _out_of_scale(step, origin, skip | unread) if found[1]["key"] in skip else found


def _out_of_scale(step: Step, origin: dict[str, Any], skip: frozenset[str] = frozenset()
                  ) -> tuple[list[int], dict[str, Any]] | None:
    mb, rows = origin.get("micro_batch") or 0, origin.get("samples") or []
    if origin.get("all_samples") or not rows:
        return outlier_rows(step, mb, skip=skip)
    found = outlier_input(step, mb, rows, skip=skip)
    if found is not None:
        return rows, found
    # (the named samples among a few rows out of scale alike, whose others did not reach the
    # op's edge: two records in the wrong unit, one labelled with its largest logit's class)
    # (not where the named samples stand out in a feature of their own, the others' largest
    # values being in another: a heavy-tailed count beside sub-ms flows' rates)
    wider = outlier_rows(step, mb, skip=skip)
    return wider if wider is not None and set(rows) <= set(wider[0]) \
        and outlier_column(step, mb, rows, skip=skip) is None else None


def outlier_input_rows(step: Step, origin: dict[str, Any], factor: float = FACTOR
                       ) -> dict[str, Any] | None:
    """The rows of a root input beside the batch that an origin's values come from
    (``origin["input_rows"]``: a support set's, a query grid's), when their largest magnitude
    is ``factor`` times that of every other row of that input, described as by
    :func:`outlier_input` (with ``rows``); None otherwise."""
    named = origin.get("input_rows") or {}
    rows, mb = named.get("rows") or [], origin.get("micro_batch") or 0
    if not rows or mb >= len(step.micro_batches):
        return None
    entry = step.micro_batches[mb]
    count = n_args(entry.get("inputs"))
    for key, raw in (entry.get("paths") or {}).items():
        t = step.tensors.get(key)
        if batch_path(raw, count) != named.get("tensor") or not isinstance(t, torch.Tensor) \
                or not t.is_floating_point() or not t.dim() or max(rows) >= t.shape[0] \
                or len(rows) >= t.shape[0]:
            continue
        per = torch.nan_to_num(t.detach().double().abs().reshape(t.shape[0], -1).amax(1),
                               nan=math.inf)
        mask = torch.zeros(len(per), dtype=torch.bool)
        mask[rows] = True
        top, others = float(per[mask].max()), float(per[~mask].max())
        if top > factor * others:
            return {"tensor": named["tensor"], "value": top, "others": others, "key": key,
                    "rows": rows}
    return None


def input_rows_hint(found: dict[str, Any]) -> str:
    """The sentence an overflow's or underflow's hint gains when those rows are out of
    scale: not samples of the batch, so no ``--try drop``."""
    which = ",".join(str(r) for r in found["rows"])
    ratio = (f", {g(found['value'] / found['others'])}x its other rows' largest "
             f"{g(found['others'])}" if found["others"] > 0 else ", its other rows being 0")
    return (f"row(s) {which} of {found['tensor']}, an input beside the batch that every named "
            f"sample goes through, reach {g(found['value'])}{ratio}: they are out of scale (a wrong "
            "unit, as query coordinates in grid cells among unit-square ones; a corrupt "
            "record), which a wider type or the op's rewrite would only hide; fix them where "
            f"{found['tensor']} is made")


def outlier_hint(found: dict[str, Any], rows: list[int], droppable: bool = True) -> str:
    """The sentence an overflow's hint gains when its samples' data is out of scale;
    ``droppable``: ``--try drop`` can remove them from the recorded batch."""
    which, how = ",".join(str(r) for r in rows), _how(rows, droppable)
    ratio = (f", {g(found['value'] / found['others'])}x the other rows' largest "
             f"{g(found['others'])}" if found["others"] > 0 else ", the other rows being 0")
    return (f"sample(s) {which} of {found['tensor']} reach {g(found['value'])}{ratio}"
            f"{integer_code(found['value'])}{_fill_text(found)}: the data of these samples is "
            "out of scale (a "
            "wrong unit, a corrupt record, a gain never normalised), which a wider type would "
            f"only hide; fix or filter them ({how})")


def _fill_text(found: dict[str, Any]) -> str:
    """What an outlier's rows say where every entry of them is one value (a fill code)."""
    if found.get("fill") is None:
        return ""
    return (f" (every entry of them is exactly {found['fill']:.10g}: a fill code written "
            "over the whole record, as a raster's or a file's nodata value, not a measurement; "
            "mask or drop it where the data is read)")


# integer types' largest values (not 8-bit ones: 255 is a plain pixel value): a -1 (a missing
# code) stored in the unsigned one wraps to it, a loader's fill for none or a saturated
# sensor reads so too
_INT_MAX = {65535: ("uint16", "2**16 - 1"), 32767: ("int16", "2**15 - 1"),
            4294967295: ("uint32", "2**32 - 1"), 2147483647: ("int32", "2**31 - 1")}


def integer_code(value: float) -> str:
    """What an outlier's largest value ``value`` says where it is exactly a 16- or 32-bit
    integer type's largest (65535: a -1 for missing read back through a uint16 array), else
    ''."""
    code = _INT_MAX.get(int(value)) if math.isfinite(value) and value == int(value) else None
    if code is None:
        return ""
    name, power = code
    wrapped = (f"a -1 (a missing-value code) read back through a {name} array wraps to it; "
               if name.startswith("u") else "")
    return (f" (exactly {int(value)} = {power}, {name}'s largest value: {wrapped}a loader's "
            "fill for none, or a sensor saturated at that range, reads so too)")


def undersized_hint(found: dict[str, Any], rows: list[int], droppable: bool = True) -> str:
    """The sentence an underflow's hint gains when its samples' data is far below the other
    rows' scale (:func:`undersized_input`)."""
    return (f"sample(s) {','.join(str(r) for r in rows)} of {found['tensor']} reach only "
            f"{g(found['value'])}, {g(found['others'] / found['value'])}x below the smallest "
            f"of the other rows' largest {g(found['others'])}: the data of these samples is "
            "out of scale (a wrong unit, as volts among microvolts; a gain or calibration "
            "never applied), which a wider type would only hide; fix or filter them "
            f"({_how(rows, droppable)})")


def _how(rows: list[int], droppable: bool) -> str:
    return (f"--try drop={','.join(str(r) for r in rows)} re-runs the step without them"
            if droppable else "the graphs of a batch concatenated node by node cannot be cut "
            "from the recorded batch: leave them out of the dataset and train again")


def outlier_column(step: Step, mb: int, rows: list[int], factor: float = FACTOR,
                   skip: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The first 2-D ``(B, F)`` floating tensor of micro-batch ``mb`` (but those in ``skip``)
    with features where the largest magnitude in ``rows`` is ``factor`` times that of every
    other row, nonzero there: ``{"tensor", "cols", "col", "value", "others", "positive"}``
    (the feature that stands out most, its magnitudes, whether that feature is never
    negative); None when there is none."""
    if not rows:
        return None
    for key, name, _missing, v in row_values(step, mb, skip):
        t = step.tensors[key]
        # (at most half the batch: most rows beyond the others is the data's scale, and one
        # row's small value in some feature says nothing of the rest)
        if t.dim() != 2 or t.shape[1] < 2 or max(rows) >= v.shape[0] or 2 * len(rows) > v.shape[0]:
            continue
        a = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0).abs()
        mask = torch.zeros(v.shape[0], dtype=torch.bool)
        mask[rows] = True
        top, others = a[mask].amax(0), a[~mask].amax(0)
        hit = (others > 0) & (top > factor * others)
        if not bool(hit.any()):
            continue
        ratio = torch.where(hit, top / others.clamp_min(1e-300), 0.0)
        j = int(ratio.argmax())
        return {"tensor": name, "cols": hit.nonzero().flatten().tolist(), "col": j,
                "value": float(top[j]), "others": float(others[j]),
                "positive": bool((torch.nan_to_num(v[:, j], nan=0.0) >= 0).all())}
    return None
