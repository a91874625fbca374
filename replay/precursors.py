"""Precursors: what jumped in the recorded steps before the event.

From the ring buffer: learning rate, gradient norm, loss and each layer's absmax per step. A
value at least ``factor`` times the median of the earlier recorded values is a jump; a float16
layer whose absmax passes half the float16 maximum is drifting towards overflow.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from .unmeasured_weights import weight_jump

# a value at least this many times the median of the earlier ones is a jump (the precursors',
# where a rewind window's trouble began, a what-if still diverging)
JUMP = 10.0

FP16_MAX = 65504.0

# how a jump of every layer's absmax that starts at the batch's first layer is worded (read by
# replay.data_scale: an overflow at that very step is the data's)
INPUT_JUMP = "the input batch's absmax jumped"


def history(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The ring buffer as plain lists: steps, loss, grad/param norm, lr, per-layer absmax."""
    if "ring/steps" not in tensors:
        return {"steps": [], "loss": [], "grad_norm": [], "param_norm": [], "lr": [],
                "layers": [], "absmax": [], "event_step": meta.get("event", {}).get("step"),
                "skipped": []}
    names = [m["name"] for m in meta.get("modules", [])]
    calls = tensors["ring/calls"]
    absmax_idx = meta.get("ring", {}).get("call_fields", []).index("absmax") \
        if "absmax" in meta.get("ring", {}).get("call_fields", []) else 2
    keys = _call_keys(tensors)
    seen = sorted({k for row in keys for k in row if k is not None})
    order: list[tuple[int, int]] = []  # series by first call in the step, over the steps
    for row in keys:
        order += [k for k in row if k is not None and k not in order]
    absmax = []
    for i, row_keys in enumerate(keys):
        row: dict[tuple[int, int], float] = {}
        for j, k in enumerate(row_keys):
            if k is None:
                continue
            v = float(calls[i, j, absmax_idx])
            if float(calls[i, j, _NAN]) == 1.0:
                v = math.nan
            prev = row.get(k)
            row[k] = v if prev is None or math.isnan(v) or (not math.isnan(prev) and v > prev) \
                else prev
        absmax.append([row.get(k) for k in seen])
    repeated = {m for m, c in seen if c > 0}
    module_names = [names[m] if m < len(names) else str(m) for m, _ in seen]
    return {
        "steps": tensors["ring/steps"].tolist(),
        "loss": tensors["ring/loss"].tolist(),
        "grad_norm": tensors["ring/grad_norm"].tolist(),
        "param_norm": tensors["ring/param_norm"].tolist(),
        "lr": tensors["ring/lr"].tolist(),
        # one series per module, and per call of a module called more than once in a
        # forward (a dropout applied twice: its calls see different values)
        "layers": [(f"{n or '<root>'} (call {c})" if m in repeated else n)
                   for n, (m, c) in zip(module_names, seen)],
        "modules": module_names,  # the module of each series
        "absmax": absmax,
        "call_order": [seen.index(k) for k in order],  # indices into "layers"
        "event_step": meta.get("event", {}).get("step"),
        "event_phase": meta.get("event", {}).get("phase"),
        "skipped": tensors["ring/skipped"].tolist(),
        "weight_norm": _event_weight_norm(meta, tensors, _weight_norms(
            tensors.get("ring/update_norms"), tensors["ring/param_norm"].tolist())),
    }


_NAN = 5  # the "nan" field of ring/calls


def _call_keys(tensors: dict[str, torch.Tensor]) -> list[list[tuple[int, int] | None]]:
    """(module, how many calls of it came before in its micro-batch) of each recorded call:
    a module's calls across micro-batches are one series, its repeated calls in one forward
    are several."""
    mods = tensors["ring/call_module"].tolist()
    mbs = tensors.get("ring/call_micro_batch")
    mbs = mbs.tolist() if mbs is not None else [[0] * len(r) for r in mods]
    out = []
    for row, mb_row in zip(mods, mbs):
        count: dict[tuple[int, int], int] = {}
        keys: list[tuple[int, int] | None] = []
        for m, mb in zip(row, mb_row):
            if m < 0:
                keys.append(None)
                continue
            c = count.get((m, mb), 0)
            count[(m, mb)] = c + 1
            keys.append((int(m), c))
        out.append(keys)
    return out


def _event_weight_norm(meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                       norms: list[float | None]) -> list[float | None]:
    """``norms`` with the event step's weight norm, when the ring has none, from the bundle's
    weights of the parameters the optimizer holds: as the update before the event step left
    them (the forward read them). With ``guard_optimizer=True`` an update's norm is measured
    as the next step closes, which an event in that step's forward never reaches, so a first
    update that blew the weights up (Lion at lr=1e38) showed no jump. A model recorded with no
    optimizer (a loop's own update, Keras's optimizer under ``recorder.keras``) has its trained
    weights taken: every parameter not frozen; the steps before take the ring's parameter norm
    (``stats="full"``). In float64: a float32 norm of finite values may overflow."""
    steps = tensors["ring/steps"].tolist()
    if not norms or norms[-1] is not None or not steps \
            or steps[-1] != meta.get("event", {}).get("step"):
        return norms
    held = [n for g in (meta.get("optimizer") or {}).get("param_groups", [])
            for n in g.get("params") or ()]
    if meta.get("optimizer") is None:  # (updates the recorder was not given: every weight)
        held = [n for n in meta.get("params") or () if n not in set(meta.get("frozen") or ())]
    ws = [w for n in held if (w := tensors.get(f"weights/{n}")) is not None
          and w.is_floating_point()]
    if not ws:
        return norms
    total = math.sqrt(sum(float(w.double().square().sum()) for w in ws))
    return [*norms[:-1], total if math.isfinite(total) else None]


def _weight_norms(update_norms: torch.Tensor | None, param_norm: list[float]
                  ) -> list[float | None]:
    """Per step, the 2-norm of the weights the optimizer holds as the update before that step
    left them (the ring's evidence of each update); None where no update ran. The steps
    before the first update take the norm of the weights they began with (``param_norm``,
    which the recorder measures until that update): the baseline of a first update that
    blew the weights up (a huge gradient at step 0, the event at step 1)."""
    if update_norms is None:
        return []
    out: list[float | None] = []
    for row in update_norms.double().tolist():
        seen = [v * v for v in row if not math.isnan(v)]
        out.append(math.sqrt(sum(seen)) if seen else None)
    first = next((i for i, v in enumerate(out) if v is not None), len(out))
    for i in range(min(first, len(param_norm))):  # (NaN where none was measured)
        out[i] = param_norm[i] if math.isfinite(param_norm[i]) else None
    return out


def module_dtypes(meta: dict[str, Any]) -> dict[str, str | None]:
    """Each recorded module's dtype: its own parameters' (or buffers'), else, for a module
    that holds none (PEFT's LoRA ``Linear`` around its ``base_layer``, an attention block of
    projections), the first of its submodules' that has one, the first registered: the layer
    it wraps, whose dtype its output is cast back to."""
    mods = meta.get("modules", [])
    out = {m["name"]: m.get("dtype") for m in mods}
    for i, m in enumerate(mods):
        name = m["name"]
        if out[name] is not None or not name:
            continue
        for d in mods[i + 1:]:  # (its submodules follow it, as named_modules lists them)
            if not d["name"].startswith(f"{name}."):
                break
            if d.get("dtype"):
                out[name] = d["dtype"]
                break
    return out


def find_precursors(hist: dict[str, Any], *, factor: float = JUMP,
                    dtypes: dict[str, str] | None = None, built=None) -> list[dict[str, Any]]:
    steps, event = hist["steps"], hist.get("event_step")
    out: list[dict[str, Any]] = []

    watched: dict[int, set[int]] = {}  # step -> layers with enough history to jump there

    def scan(values, kind, what, layer=None, least=2, one=False):
        """A jump (a value ``factor`` times the median of the ``least`` or more before) is one
        line, however many steps stay above that after it (a learning rate set higher, a
        runaway growth): the line says through which step and how far it went. A layer's
        absmax of exactly 0 (an output identically zero: a zero-initialised branch, LoRA's
        ``B``, before its first updates) measures no scale and is no baseline: growth from it
        is training starting, not a jump. ``one``: see :func:`_unmistakable`."""
        seen = []
        run = None  # the jump the steps since have stayed above the median with
        for s, v in zip(steps, values):
            if event is not None and s > event:
                break
            if v is None or not math.isfinite(v) or (layer is not None and v == 0):
                continue
            if len(seen) >= least or one and _unmistakable(seen, v, factor):
                med = statistics.median(seen)
                if med > 0 and v >= factor * med and run is not None:
                    run["more"], run["through"] = run["more"] + 1, s
                    run["top"] = max(run["top"], v / med)
                elif med > 0 and v >= factor * med:
                    run = {"step": s, "kind": kind, "ratio": v / med, "layer": layer,
                           "detail": f"{what} {v:.4g} is {v / med:.3g}x the median "
                                     f"{med:.4g} of the {len(seen)} step{'s' * (len(seen) > 1)} before",
                           "more": 0, "through": s, "top": v / med}
                    out.append(run)
                else:
                    run = None
                if layer is not None:
                    watched.setdefault(s, set()).add(layer)
            seen.append(abs(v))

    groups = len(hist["lr"][0]) if hist["lr"] else 0
    for g in range(groups):
        scan([row[g] for row in hist["lr"]], "lr_jump",
             "learning rate" + (f" (group {g})" if groups > 1 else ""))
    if groups > 1:
        out += _added_groups(hist, factor, event)
    scan(hist["grad_norm"], "grad_norm_jump", "gradient norm", one=True)
    # weights are state, not a noisy measure: one earlier value is a baseline
    scan(hist.get("weight_norm") or [], "weight_jump",
         "weight norm (as the update before left them)", least=1)
    scan(hist["loss"], "loss_jump", "loss", one=True)
    for li, layer in enumerate(hist["layers"]):
        col = [row[li] for row in hist["absmax"]]
        scan(col, "absmax_jump", f"absmax of {layer or '<root>'}", li)
        if dtypes and dtypes.get(module := hist.get("modules", hist["layers"])[li]) == "float16":
            out += _near_fp16_max(steps, col, layer, event, module)
    out = _innermost_fp16(out + _absorbed_fp16_overflow(hist, dtypes or {}))
    for p in out:
        p["detail"] += _held(p)
    out = _one_line_per_jump(out + overflowed_norms(hist), hist, watched, built)
    out.sort(key=lambda p: (p["step"], p["kind"]))
    return [{k: p[k] for k in ("step", "kind", "detail")} for p in out]


def _unmistakable(seen: list[float], v: float, factor: float) -> bool:
    """A jump from the one step before of ``factor ** 3`` or more (a thousandfold): one
    baseline is too few for a noisy measure's median, but no noise makes such a jump (a
    learning rate 100x too high, diverging from the first update: a polynomial fit's loss
    462, 2.1e9, inf)."""
    return len(seen) == 1 and seen[0] > 0 and v >= factor ** 3 * seen[0]


# the norms the ring holds whose +inf the recorder's checks show to be an overflow of the norm
# alone: each gradient is checked before the update (a step with a non-finite one is an event,
# or a GradScaler's skipped step) and each weight after it, so +inf there means the float32 sum
# of squares of finite values passed float32's largest: a norm of 1.8e19 or more, a jump whose
# ratio no median measures (DP-SGD's noise at noise_multiplier 1e30 in one update; a learning
# rate of 1e20). (column, kind, what, whether the event step's own value counts: the weights as
# the update before the event left them do)
_NORMS = (("grad_norm", "grad_norm_jump", "gradient norm", False),
          ("weight_norm", "weight_jump", "weight norm (as the update before left them)", True))


def overflowed_norms(hist: dict[str, Any]) -> list[dict[str, Any]]:
    """A jump at the first step each norm of ``_NORMS`` is +inf (finite values whose float32
    norm overflowed), not at a skipped step nor after the event."""
    event, skipped = hist.get("event_step"), hist.get("skipped") or []
    out = []
    for col, kind, what, at_event in _NORMS:
        values = hist.get(col) or []
        for i, (s, v) in enumerate(zip(hist["steps"], values)):
            if event is not None and (s > event or s == event and not at_event):
                break
            if v != math.inf or i < len(skipped) and skipped[i]:
                continue
            seen = [abs(x) for x in values[:i] if x is not None and math.isfinite(x)]
            base = (f", from a median of {statistics.median(seen):.4g} over the {len(seen)} "
                    f"step{'s' * (len(seen) > 1)} before") if seen else ""
            out.append({"step": s, "kind": kind, "ratio": math.inf, "layer": None, "more": 0,
                        "through": s, "top": math.inf,
                        "detail": f"{what} overflowed float32 (inf){base}: its values were "
                                  "finite, the norm 1.8e19 or more"})
            break
    return out


def _added_groups(hist: dict[str, Any], factor: float, event) -> list[dict[str, Any]]:
    """A parameter group added mid-run (``add_param_group``: layers unfrozen) with a learning
    rate ``factor`` times the other groups': a jump the per-group scan cannot see, as the
    group has no rates before it. Held through the steps its rate stays that far above."""
    out: list[dict[str, Any]] = []
    steps, lrs = hist["steps"], hist["lr"]
    for g in range(len(lrs[0])):
        run = None
        for i, (s, row) in enumerate(zip(steps, lrs)):
            if event is not None and s > event:
                break
            others = [v for k, v in enumerate(row) if k != g and math.isfinite(v) and v > 0]
            v = row[g]
            high = math.isfinite(v) and others and v >= factor * statistics.median(others)
            if run is not None:
                if not high:
                    break
                run["more"], run["through"] = run["more"] + 1, s
            elif high and i > 0 and not math.isfinite(lrs[i - 1][g]):
                med = statistics.median(others)
                run = {"step": s, "kind": "lr_jump", "ratio": v / med, "top": v / med,
                       "more": 0, "through": s,
                       "detail": f"learning rate (group {g}) {v:.4g}, of a group added at "
                                 f"step {s}, is {v / med:.3g}x the other groups' {med:.4g}"}
                out.append(run)
            elif math.isfinite(v):
                break  # the group's first rate was not far above: no added-group jump
    return out


def _near_fp16_max(steps: list[int], col: list, layer: str, event: int | None,
                   module: str) -> list[dict[str, Any]]:
    """The first step (up to the event) where a float16 layer's absmax passed half the
    float16 maximum, if any."""
    for s, v in zip(steps, col):
        if v is not None and math.isfinite(v) and v > FP16_MAX / 2 and \
                (event is None or s <= event):
            return [{"step": s, "kind": "near_fp16_max", "module": module,
                     "detail": f"absmax of {layer} is {v:.4g}, past half the float16 maximum "
                               f"{FP16_MAX:g}"}]
    return []


def _absorbed_fp16_overflow(hist: dict[str, Any], dtypes: dict[str, str]) -> list[dict[str, Any]]:
    """The first float16 call (by step, then in the order the calls completed) whose output
    held an infinity the event did not name: an overflow the model's own code absorbed (T5's
    blocks clamp float16 infinities to 64504, a masked_fill drops them), so the values it
    passed on were wrong from that step. At the event's step only when the event is not the
    step's forward or loss (those name the overflowing call themselves)."""
    event, phase = hist.get("event_step"), hist.get("event_phase")
    order = hist.get("call_order") or list(range(len(hist["layers"])))
    mods = hist.get("modules", hist["layers"])
    for s, row in zip(hist["steps"], hist["absmax"]):
        if event is not None and (s > event or s == event and phase in _NAMED_HERE):
            break
        li = next((li for li in order if li < len(row) and row[li] == math.inf
                   and dtypes.get(mods[li]) == "float16"), None)
        if li is not None:
            return [{"step": s, "kind": "fp16_overflow_absorbed", "module": mods[li],
                     "detail": f"{hist['layers'][li] or '<root>'}'s float16 output held an "
                               f"infinity (past {FP16_MAX:g}) that no event named: the code "
                               "after it absorbed it (a clamp, as T5's float16 blocks do; a "
                               "masked_fill), so what it passed on was wrong from there"}]
    return []


_NAMED_HERE = ("forward", "loss", "input")
_FP16 = ("near_fp16_max", "fp16_overflow_absorbed")


def _innermost_fp16(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The float16 lines of the innermost modules: a container's output (a T5 block, PEFT's
    ``base_model``, the root) near float16's maximum is a submodule's, named at that step or
    before, and one line for it is enough."""
    fp16 = [p for p in found if p["kind"] in _FP16]

    def inside(a: str, b: str) -> bool:
        return a != b and (b == "" or a.startswith(b + "."))

    return [p for p in found if p["kind"] not in _FP16 or not any(
        inside(q["module"], p["module"]) and q["step"] <= p["step"] for q in fp16)]


def _one_line_per_jump(out: list[dict[str, Any]], hist: dict[str, Any],
                       watched: dict[int, set[int]], built=None) -> list[dict[str, Any]]:
    """Absmax jumps of several layers at one step are one jump seen through the layers after
    the first one called: one line for them, naming that first layer (the input batch when it
    is the first layer of the forward and the update before that forward, which wrote its
    weights, came with no learning-rate or gradient-norm jump and left no weight-norm jump: an
    embedding's absmax is its weights'). ``built``: where no weight norm was measured (a
    loop's own update), a function giving the factory's model's, which says whether the
    weights grew instead (``replay.unmeasured_weights``)."""
    order = hist.get("call_order") or list(range(len(hist["layers"])))
    rank = {li: i for i, li in enumerate(order)}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for p in out:
        if p["kind"] == "absmax_jump":
            by_step.setdefault(p["step"], []).append(p)
    steps = hist["steps"]
    # the first layer that takes the batch: a parametrization's module (spectral_norm, LoRA
    # as one) is called first too, but on a weight, whose jump is no jump of the data
    batch_first = next((li for li in order
                        if ".parametrizations." not in f".{hist['layers'][li]}"), None)
    keep = [p for p in out if p["kind"] != "absmax_jump" or len(by_step[p["step"]]) == 1]
    for s, group in by_step.items():
        if len(group) == 1:
            continue
        group.sort(key=lambda p: rank.get(p["layer"], len(rank)))
        first = group[0]
        name = hist["layers"][first["layer"]] or "<root>"
        every = {p["layer"] for p in group} >= watched.get(s, set())
        at = steps.index(s) if s in steps else None
        # the update of the step before wrote the weights this forward used
        # (or a jump held since: a learning rate set higher and kept there)
        before = steps[at - 1] if at else None
        near = [q for q in out if q["kind"] in ("lr_jump", "grad_norm_jump")
                and before is not None and q["step"] <= before <= q.get("through", q["step"])
                or q["kind"] == "weight_jump" and q["step"] <= s <= q["through"]]
        grew = every and first["layer"] == batch_first and not near and built is not None \
            and _grown(hist, built, keep, s)
        if every and first["layer"] == batch_first and not near and not grew:
            detail = (f"{INPUT_JUMP} {first['ratio']:.3g}x (seen at {name}, "
                      f"the first layer called); every layer followed ({len(group)} layers)")
        elif every:
            detail = (f"absmax of {name} jumped {first['ratio']:.3g}x; every layer followed "
                      f"({len(group)} layers)")
        else:
            detail = (f"absmax of {name} jumped {first['ratio']:.3g}x; {len(group) - 1} "
                      f"layer{'s' if len(group) > 2 else ''} after it followed ("
                      + ", ".join(hist["layers"][p["layer"]] or "<root>" for p in group[1:4])
                      + (", ..." if len(group) > 4 else "") + ")")
        keep.append({"step": s, "kind": "absmax_jump", "detail": detail + _held(first)})
    return keep


def _grown(hist: dict[str, Any], built, keep: list[dict[str, Any]], s: int) -> bool:
    """Whether weights no update measured may have made a jump at step ``s`` from the batch's
    first layer: a step before the event's (its weights are in no bundle), no factory's model
    to compare with, or the event's weights far past it (then added to ``keep`` as a weight
    jump, once)."""
    if any(p["kind"] == "weight_jump" for p in keep):
        return True
    norm = built()
    jump = weight_jump(hist, norm)
    if jump is not None:
        keep.append({k: jump[k] for k in ("step", "kind", "detail")})
    return s != hist.get("event_step") or norm is None or jump is not None


def _held(p: dict[str, Any]) -> str:
    """How long a jump's steps stayed above the median after it, for its line."""
    more = p.get("more", 0)
    if not more:
        return ""
    top = f", up to {p['top']:.3g}x" if p["top"] > p["ratio"] else ""
    return f"; above it through step {p['through']} ({more} more step{'s' if more > 1 else ''}{top})"


# the noisy per-batch measures: a jump in one of them is growth only when the weights moved
# with it (the learning rate and the weights are state, which stays where it went)
_MEASURES = {"loss_jump": "loss", "grad_norm_jump": "grad_norm"}
# weights that grew less than this fraction since such a jump were not driven by it
_STILL = 0.1


def transient(hist: dict[str, Any], jump: dict[str, Any], *, factor: float = JUMP) -> bool:
    """Whether ``jump`` (a loss or gradient-norm jump) was a spike that did not lead to the
    event: a recorded step between it and the event fell back below ``factor`` times the
    median of the values before it, and the norm of the weights the optimizer holds grew less
    than 10% from the jump to the event (a search's hard validation batch 28 steps before an
    entropy term's softmax underflowed); a run that diverged grows its weights (a Glow at a
    learning rate of 0.5: its loss spikes and falls back while they triple)."""
    col = _MEASURES.get(jump.get("kind"))
    event = hist.get("event_step")
    if col is None or event is None:
        return False
    before, after, weights = [], [], []
    norms = hist.get("weight_norm") or [None] * len(hist["steps"])
    for s, v, w in zip(hist["steps"], hist.get(col) or [], norms):
        if jump["step"] <= s <= event and w is not None and math.isfinite(w):
            weights.append(w)
        if v is None or not math.isfinite(v):
            continue
        if s < jump["step"]:
            before.append(abs(v))
        elif jump["step"] < s < event:
            after.append(abs(v))
    if not before or not after or len(weights) < 2 or weights[0] <= 0:
        return False
    med = statistics.median(before)
    return any(v < factor * med for v in after) and weights[-1] < (1 + _STILL) * weights[0]
