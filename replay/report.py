"""The report as text (for people); its JSON form and ``--info`` are in :mod:`replay.info`."""

from __future__ import annotations

from typing import Any

from recorder.loss_forwards import forward_in_loss_phrase

from .cause_text import module_label
from .edited_rerun import NOT_MADE
from .event_when import event_when
from .fidelity import describe
from .rewind_text import what_if_lines, window_lines
from .tied_names import tied_text


def _first_param(params: list[str]) -> str:
    """The first parameter's name, and how many more there are."""
    return params[0] + (f" (+{len(params) - 1} more)" if len(params) > 1 else "")


def _micro_batch(o: dict[str, Any], several: bool) -> str:
    """``, micro-batch N`` of the origin: micro-batch 0 too where the step ran several (an
    accumulation window), whose samples are that micro-batch's rows, not the step's; and what
    it is when the loss opened it by calling the model (recorder.loss_forwards)."""
    mb = o.get("micro_batch")
    return f", {forward_in_loss_phrase(mb, bool(o.get('forward_in_loss')))}" \
        if mb or (mb == 0 and several) else ""


def _where(o: dict[str, Any], several: bool = False) -> str:
    mb = _micro_batch(o, several)
    if o.get("phase") == "input":  # (its samples are rows of that micro-batch's input)
        arg = f" ({o['arg']})" if o.get("arg") else ""  # (forward's name: replay.loss_arg_name)
        return (f"the input {o['tensor']}{arg}" if o.get("tensor") else "the model's input") + mb
    if o.get("phase") in ("weights", "optimizer"):
        params = o.get("params") or []
        what = "buffer" if o.get("tensor") == "buffer" else "parameter"
        more = f" (+{len(params) - 1} more)" if len(params) > 1 else ""
        return f"{what} {params[0]}{tied_text(o)}{more}" if params else "the parameters"
    mod = o.get("module")
    name = module_label(mod)
    if o.get("scripted"):  # (a TorchScript module's op: checked at its hooked caller)
        name = f"{o['scripted']}, a TorchScript module of {name}"
    call = f", call {o['call']}" if o.get("call") is not None else ""
    call += f" (called at {o['called_at']})" if o.get("called_at") else ""
    if mod == "<loss>" and o.get("forward_in_loss"):  # (the loss's op, not its model call's)
        return f"{name} (filed under {mb[2:]})"
    return f"{name}{call}{mb}"


def _read_by(o: dict[str, Any], several: bool) -> str:
    """The op and module call that first read a weights origin's bad values, and the name
    that module holds a tied parameter by (replay.tied_names)."""
    read = f"{o['op']} in " if o.get("op") else ""
    alias = f", as {o['read_as']}" if o.get("read_as") else ""
    return f"{read}{_where({**o, 'phase': None}, several)}{alias}"


def to_text(report: dict[str, Any]) -> str:
    """The text report: the verdict line, then one labelled line per finding."""
    ev = report["event"]
    state = ("reproduced" if report["reproduced"] else
             f"not re-run ({report['not_rerun']})" if report.get("not_rerun") else
             NOT_MADE if report.get("edited_code") else  # (an edit's what-if)
             "NOT reproduced")
    lines = [f"nanreplay: {event_when(ev)}, {ev.get('phase') or 'unlocated'} event — {state}"]
    lines += rank_lines(report)
    lines += _origin_lines(report)
    lines += _cause_lines(report)
    lines += window_lines(report) + what_if_lines(report)
    lines += _note_lines(report)
    pre = report.get("precursors", [])
    if pre:
        lines.append("  precursors")
        for p in pre[:10]:
            lines.append(f"    step {p['step']:>6}  {p['kind']:<15} {p['detail']}")
        if len(pre) > 10:
            lines.append(f"    ... {len(pre) - 10} more")
    return "\n".join(lines)


# the text report's labels that the HTML page shows as they are (its other lines have a section)
DETAIL_LABELS = ("entered", "read by", "fidelity", "recorded", "anomaly", "coupled", "note")


def detail_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of the text report's lines that say more than the origin, the chain, the
    samples, the cause and the sections the HTML page draws: where the value entered, who read
    corrupted weights, a replay that ran differently from the recorded step, a compiled call
    replayed eagerly, anomaly mode's node, coupled rows, and the notes (a stripped bundle, a
    loss not called through ``rec.loss_fn``, ...), worded as the text report words them."""
    origin = isinstance(report.get("origin"), dict) and isinstance(report.get("event"), dict)
    lines = (_origin_lines(report) if origin else []) + _note_lines(report)
    pairs = [(line[:13].strip(), line[13:]) for line in lines]  # "  label      text"
    return [(label, text) for label, text in pairs if label in DETAIL_LABELS]


def _note_lines(report: dict[str, Any]) -> list[str]:
    return [f"  note       {p}" for p in report.get("problems", [])]


def rank_lines(report: dict[str, Any]) -> list[str]:
    """Which rank's step the report is of, when that is not plain: another rank's bundle
    replayed (the samples are rows of its batch, not of the given bundle's), or this rank's
    own view of an event another rank saw first (its bundle not beside it, or stripped)."""
    b = report.get("bundle") or {}
    first, rank = b.get("first_ranks"), b.get("rank")
    if b.get("given"):
        return [f"  rank       replayed rank {rank}'s bundle {b['path']}, the first rank to see "
                f"the event (the samples are rows of its batch); the bundle given is rank "
                f"{b.get('given_rank')}'s"]
    if first and rank not in first:
        return [f"  rank       rank {rank} of {b.get('world_size')}: rank(s) {first} saw the "
                f"event first; this is rank {rank}'s own view: replay rank {min(first)}'s "
                "bundle to see where it began"]
    return []


def _origin_lines(report: dict[str, Any]) -> list[str]:
    """Origin, fidelity, compiled region, source, chain, anomaly and samples lines."""
    ev, o = report["event"], report["origin"]
    several, lines = (ev.get("micro_batches") or 0) > 1, []  # (several: a window's)
    made = o.get("made") or ev.get("kind") or "non-finite value"
    if o.get("phase") and o.get("detail"):  # a sentence instead of an op (replay.outside)
        lines.append(f"  origin     {o['phase']}: {o['detail']}")
        if o.get("positions"):
            n = o["positions"]
            mb = _micro_batch(o, several)
            lines.append(f"  entered    {made} in {n['non_finite']} of {n['of']} elements of the "
                         f"recorded {o.get('tensor') or 'gradient'}{mb}")
    elif o.get("phase") and not o.get("op") and o.get("module") is None \
            and o["phase"] not in ("input", "weights", "optimizer"):
        # what the recorder saw, with no op or module to name (nothing re-run says more)
        params = o.get("params") or []
        thing = (f"the gradient of {_first_param(params)}" if params else
                 f"the {o['tensor']}" if o.get("tensor") else "a value no check names")
        lines.append(f"  origin     {o['phase']}: {made} in {thing}")
    elif o.get("phase"):
        op = f"{o['op']} in " if o.get("op") and o["phase"] != "weights" else ""
        if o.get("node"):  # an op of a derivative the forward took itself
            op = f"{o['op']} of {o['node']}" + (f" ({o['node_source']})"
                                                if o.get("node_source") else "") + " in "
        fin = ", inputs finite" if o.get("inputs_finite") else ""
        # (a loop over time steps: the line ran the op before, finite; replay.iteration)
        fin += f", run {o['line_run']} of its line" if (o.get("line_run") or 0) > 1 else ""
        lines.append(f"  origin     {o['phase']}: {made} made by {op}{_where(o, several)}{fin}")
        if o["phase"] == "weights" and o.get("module") is not None:  # replay.weight_readers
            lines.append(f"  read by    {_read_by(o, several)}, first in the forward")
    fid = report.get("fidelity")
    if fid and fid.get("matches") is False:
        lines.append(f"  fidelity   {describe(fid)}")
    if ev.get("compiled"):
        name = module_label(ev.get("module"))
        lines.append(f"  recorded   '{name}' as one torch.compile'd call; this replay ran its "
                     "layers eagerly")
    if o.get("source"):
        text = _source_text(report, o)
        lines.append(f"  source     {o['source']}" + (f"    {text}" if text else ""))
    chain = o.get("chain") or []
    if len(chain) > 1:
        lines.append("  chain      " + " -> ".join(
            f"{c['op']} made {c['made']}" + (f" ({c['source']})" if c.get("source") else "")
            + (" [intentional]" if c.get("intentional") else "") for c in chain))
    if o.get("anomaly_node") and o.get("anomaly_node") != o.get("op"):
        lines.append(f"  anomaly    detect_anomaly names {o['anomaly_node']}")
    if o.get("samples"):
        s = o["samples"]
        if o.get("all_samples"):
            lines.append(f"  samples    all {len(s)} rows" if len(s) > 1 else "  samples    [0]")
        else:
            lines.append(f"  samples    {s[:16]}" + (f" (+{len(s) - 16})" if len(s) > 16
                                                      else ""))
    if more := sorted(set(o.get("coupled") or []) - set(o.get("samples") or [])):
        lines.append(f"  coupled    {more[:16]}: the loss combines their rows with the samples' "
                     "(a pair, a group), so their gradient is non-finite too")
    return lines


def _cause_lines(report: dict[str, Any]) -> list[str]:
    """The cause with its hint (the wording is the report's, from replay.cause_text and
    replay.cause), and the bisection."""
    lines = []
    if report.get("cause"):
        lines.append(f"  cause      {report['cause']} — {report.get('hint') or ''}".rstrip(" —"))
    elif report.get("hint"):
        lines.append(f"  cause      unknown — {report['hint']}")
    b = report.get("bisection")
    if b:
        agree = "agrees with" if b["agrees"] else "DISAGREES with"
        lines.append(f"  bisection  {b['probes']} re-runs over {b['calls']} calls "
                     f"(limit {b['limit']}), {agree} the instrumented pass")
    return lines


def _source_text(report: dict[str, Any], o: dict[str, Any]) -> str:
    """The origin's source line's text, and the line of the user's code that called into the
    installed package it lies in (``origin.called_from``)."""
    text = report.get("source_lines", {}).get(o["source"], "").strip()
    called = o.get("called_from")
    return text + (f"    (called from {called})" if called else "")
