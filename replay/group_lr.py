"""``--try lr[G]=VALUE``: one parameter group's learning rate changed, the others as recorded.

Fine-tuning runs give each group its own rate (a backbone at 1e-5, a head at 1e-3, a no-decay
group of norms and biases); ``lr=VALUE`` sets every group's to VALUE, which changes the groups
that were not at fault too (a head's 1e6 set back to 1e-3 along with a backbone raised 100x),
so a try of it is told so, and auto restores the rate of the one group whose rate jumped.

>>> split_group("lr[2]")
('lr', 2)
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from .errors import ReplayError
from .precursors import JUMP

_INDEXED = re.compile(r"^(\w+)\[\s*(\d+)\s*\]$")


def split_group(key: str) -> tuple[str, int | None]:
    """``("lr", 2)`` of ``lr[2]``, ``(key, None)`` of a key without an index; ValueError
    (the one-line message) for an index on another key than lr."""
    m = _INDEXED.match(key)
    if m is None:
        return key, None
    if m.group(1) != "lr":
        raise ValueError(f"only lr takes a parameter group index ({key}): --try "
                         f"{m.group(1)}=VALUE applies to every group")
    return "lr", int(m.group(2))


def new_lr(v: Any, i: int, change) -> Any:
    """Group ``i``'s learning rate under the change (``replay.window.Change``): ``v`` as
    recorded when the change sets no rate, or another group's."""
    if change.lr_group is not None and i != change.lr_group:
        return v
    if change.lr is not None:
        return change.lr
    return v * change.lr_factor if change.lr_factor is not None and v is not None else v


def check_group(opt, label: str, change) -> None:
    """Refuse (one line) a group index past the optimizer's groups."""
    n = len(opt.param_groups)
    if change.lr_group is not None and change.lr_group >= n:
        raise ReplayError(f"--try {label}: the optimizer has {n} parameter group"
                          f"{'s' if n != 1 else ''} (0-{n - 1}); pass a group index within "
                          "them, or lr=VALUE for every group")


def every_group_note(groups: list[dict[str, Any]] | None, label: str, change) -> str | None:
    """What an absolute ``lr=VALUE`` did to ``groups`` (a window record's ``hyper``)
    recorded at different rates: it set them all, not only the group at fault; None when
    the groups shared one rate."""
    if not groups or change.lr is None or change.lr_group is not None:
        return None
    rates = [g.get("lr") for g in groups]
    shown = [f"{r:.3g}" if _number(r) else r if isinstance(r, str) else "?" for r in rates]
    if len(rates) < 2 or len(set(shown)) < 2:
        return None
    value = label.partition("=")[2]
    return (f"{label} set all {len(rates)} parameter groups' learning rates, recorded at "
            f"{', '.join(shown)}, to {value}; lr[G]={value} sets group G's alone "
            f"(G in 0-{len(rates) - 1})")


def lr_before_jump(report: dict[str, Any]) -> str | None:
    """The try of the rate the run trained at before the learning-rate jump the rewind window
    began with (a rate set 1e5x higher: a tenth of it is still far too high): the median of
    the jumped group's rates over the window's steps before it, for that group alone
    (``lr[G]=``) when the other groups kept theirs at that step, else for every group; None
    when the window began with no such jump."""
    w = report.get("window") or {}
    began = w.get("precursors_began") or {}
    if began.get("kind") != "lr_jump":
        return None
    g, at = began.get("group"), began["step"]
    rows = [s for s in w.get("per_step") or [] if s.get("step") is not None]
    rates = [v for s in rows if s["step"] < at and _number(v := _rate(s, g)) and v > 0]
    if began.get("before") is not None:  # (a group added at the jump: the others' rate)
        rates = [began["before"]]
    if not rates:
        return None
    value = f"{statistics.median(rates):.3g}"
    return f"lr[{g}]={value}" if g is not None and _alone(rows, at, g) else f"lr={value}"


def last_finite_lr(step) -> str | None:
    """The try of a rate for an update whose rate was NaN, Inf or below 0 (a schedule run
    past its end): when one group's alone was (a head's decay over 0 steps, 0/0), that
    group's last finite rate before the event step, for it alone; else the largest rate of
    the last step before it whose rates were all finite, none below 0 and not all 0, or the
    largest rate the scheduler started from; None when there is none."""
    lrs, steps = step.tensors.get("ring/lr"), step.tensors.get("ring/steps")
    rows = lrs.tolist() if lrs is not None else []
    at = step.event.get("step")
    kept = steps.tolist() if steps is not None and len(steps) == len(rows) else []
    now = next((r for r, s in zip(rows, kept) if s == at), None)
    if kept and at is not None:  # (rows after the event: rates the loop set after it)
        rows = [r for r, s in zip(rows, kept) if s < at]
    bad = [g for g, v in enumerate(now or []) if not 0 <= v < math.inf]
    if now and len(now) > 1 and len(bad) == 1:
        g = bad[0]
        last = next((r[g] for r in reversed(rows) if 0 < r[g] < math.inf), None)
        if last is not None:
            return f"lr[{g}]={last:.3g}"
    for row in reversed(rows):
        if row and all(0 <= v < math.inf for v in row) and max(row) > 0:
            return f"lr={max(row):.3g}"
    # none yet (a warm-up's (w / s) ** 0.5 is Inf at step 0, the ring's first row): the rate
    # the loop set, which a scheduler keeps in each group as ``initial_lr``
    first = [float(g["initial_lr"]) for g in step.optimizer.param_groups if "initial_lr" in g]
    return f"lr={max(first):.3g}" \
        if first and all(math.isfinite(v) for v in first) and max(first) > 0 else None


def jumped_group(step) -> dict[str, Any] | None:
    """The one parameter group whose learning rate jumped ``JUMP``-fold or more over its
    median before, up to the event step, and was still that high there, while the other
    groups kept theirs at that step (a hand-written schedule that set the head's rate to 1e6):
    ``{"group", "step", "before", "now"}``; None with one group, or several jumped."""
    lrs, steps = step.tensors.get("ring/lr"), step.tensors.get("ring/steps")
    if lrs is None or steps is None or lrs.dim() != 2 or lrs.shape[1] < 2 \
            or len(steps) != len(lrs):
        return None
    at = step.event.get("step")
    rows = [(s, r) for s, r in zip(steps.tolist(), lrs.tolist()) if at is None or s <= at]
    found = [j for g in range(lrs.shape[1]) if (j := _jump(rows, g)) is not None]
    if len(found) != 1:
        return None
    i = next(k for k, (s, _) in enumerate(rows) if s == found[0]["step"])
    g, (before, now) = found[0]["group"], (rows[i - 1][1], rows[i][1])
    return found[0] if all(a == b for j, (a, b) in enumerate(zip(before, now)) if j != g) \
        else None


def jumped_group_text(step) -> str:
    """The sentence on that group for an optimizer event's remedy, or ''."""
    if (j := jumped_group(step)) is None:
        return ""
    g, before, at = j["group"], j["before"], j["step"]
    records = (step.meta.get("rewind") or {}).get("records") or []
    first = min((r["step"] for r in records), default=None)
    # (the update re-run is the jump step's own, or a window holds it)
    direct = at >= (step.event.get("step") or 0) or (first is not None and first <= at)
    test = f"--try lr[{g}]={before:.3g} tests it" if direct else (
        f"a bundle recorded with FlightRecorder(..., rewind=N) from before step {at} tests it "
        f"with --try lr[{g}]={before:.3g}: this one's update already starts from the weights "
        "the rate grew")
    return (f"; parameter group {g}'s learning rate jumped to {j['now']:.3g} at step "
            f"{at}, {j['now'] / before:.3g}x its median {before:.3g} before, while the "
            f"other groups kept theirs: set that group's rate back ({test})")


def _jump(rows: list[tuple[int, list[float]]], g: int) -> dict[str, Any] | None:
    seen: list[float] = []
    for s, r in rows:
        v = r[g]
        if not 0 < v < math.inf:  # (a group added later: NaN before it)
            continue
        if seen and v >= JUMP * (base := statistics.median(seen)):
            now = rows[-1][1][g]
            return {"group": g, "step": s, "before": base, "now": now} \
                if now >= JUMP * base else None
        seen.append(v)
    return None


def _rate(row: dict[str, Any], g: int | None) -> Any:
    lrs = row.get("group_lrs") or []
    return row.get("lr") if g is None else lrs[g] if g < len(lrs) else None


def _alone(rows: list[dict[str, Any]], at: int, g: int) -> bool:
    """Whether only group ``g``'s rate changed at step ``at`` (the others as the step
    before)."""
    i = next((k for k, s in enumerate(rows) if s["step"] == at), 0)
    if i == 0:
        return False
    before, now = rows[i - 1].get("group_lrs") or [], rows[i].get("group_lrs") or []
    return all(a == b for j, (a, b) in enumerate(zip(before, now)) if j != g)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
