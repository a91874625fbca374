"""A self-contained HTML page for one replay report.

``render_html(report, history)`` returns one HTML document with everything inline: CSS in a
``<style>`` element, plots as SVG built here, no script, no fonts, no images, and a
Content-Security-Policy that forbids any request. Top to bottom: the verdict, the ring-buffer
plots (per-layer absmax heatmap on a log colour scale with the event column marked; loss,
gradient norm and learning rate over steps with a line at the event), then the origin with its
source line, the chain, precursors and the bisection. Under the verdict, the notes: the text
report's other lines (a stripped bundle, who read corrupted weights, a replay that differed).

Every string from the report or the history is untrusted (it comes from a bundle) and is passed
through :func:`html.escape` before it reaches the page. Stable ids for tests and tooling:
``verdict``, ``heatmap`` (``rect.cell`` with ``data-layer``/``data-step``/``data-value``),
``plot-loss``, ``plot-grad-norm``, ``plot-lr`` (each with ``path.series``), ``origin``,
``precursors``, ``bisection``, ``notes`` (where there are any).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from recorder.finite import LABELS
from recorder.loss_forwards import forward_in_loss_phrase

from .cause_text import MEANING, module_label
from .rewind_text import what_if_html, window_html
from .tied_names import tied_text

__all__ = ["render_html"]

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"  # no script at all
BAD = "#e03131"  # non-finite values, in every plot
EVENT = "#1c1c1c"  # the event step, dashed, in every plot
MISSING = "#e9ecef"  # not recorded
SERIES = ("#1971c2", "#2f9e44", "#f08c00", "#9c36b5", "#0c8599", "#c2255c")
VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 color:#212529;background:#f8f9fa;margin:0}
main{max-width:1120px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:20px;margin:0 0 2px}h2{font-size:16px;margin:26px 0 8px}
h3{font-size:14px;margin:8px 0 4px}section h3~h3{margin-top:22px}
.meta{color:#6c757d;font-size:12px}
section{background:#fff;border:1px solid #dee2e6;border-radius:6px;padding:12px 16px;margin-top:12px}
#verdict{border-left:6px solid #e03131;font-size:16px}
#verdict.ok{border-left-color:#868e96}
#verdict p{margin:4px 0}.hint{white-space:pre-wrap;color:#495057;font-size:14px}
.scroll{overflow-x:auto}svg{display:block}svg text{font:11px ui-monospace,Menlo,Consolas,monospace;fill:#495057}
svg .title{font:600 12px system-ui,sans-serif;fill:#212529}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;font-size:12px;color:#495057;margin:6px 0}
.sw{display:inline-block;width:14px;height:12px;vertical-align:middle;margin-right:4px;border:1px solid #adb5bd}
.grad{display:inline-block;width:140px;height:12px;vertical-align:middle;margin:0 4px;
 background:linear-gradient(90deg,#440154,#3b528b,#21918c,#5ec962,#fde725)}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#6c757d;font-weight:600}code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f1f3f5;border-radius:4px;padding:6px 10px;margin:4px 0;overflow-x:auto}
.none{color:#868e96;font-style:italic}
"""


def _e(x: Any) -> str:
    """Escape anything for text or a quoted attribute."""
    return html.escape("" if x is None else str(x), quote=True)


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _num(v: Any) -> float | None:
    """A float (possibly nan/inf), or None for missing or non-numeric values."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt(v: float | None) -> str:
    if v is None:
        return "none"
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return format(v, ".3g")


def _list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else []


def _viridis(t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    f = t - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(VIRIDIS[i], VIRIDIS[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def _verdict(report: dict) -> str:
    origin = _get(report, "origin") or {}
    event = _get(report, "event") or {}
    cause, hint = _get(report, "cause"), _get(report, "hint")
    chain = _list(_get(origin, "chain"))
    # what the blamed op made: its chain entry (an intentional -inf mask may come first)
    blamed = [c for c in chain if isinstance(c, dict) and c.get("op") == _get(origin, "op")]
    made = str(_get(origin, "made") or (_get(blamed[0], "made") if blamed else "")
               or (_get(chain[0], "made") if chain else "") or "")
    # the kind in words (recorder.finite's), +Inf without its sign: "Inf first made by"
    what = LABELS.get(made.lower().removeprefix("+"), made) or "A non-finite value"
    step = _get(event, "step")
    if not event:
        text = "No non-finite value was recorded in this bundle."
    elif _get(report, "reproduced") is False or not origin:
        where = ", ".join(_e(x) for x in (_get(event, "phase"), module_label(_get(event, "module")))
                          if x)
        why = _get(report, "not_rerun")
        state = (f"was <b>not re-run</b> ({_e(why)})" if why
                 else "was <b>not reproduced</b> on replay")
        text = (f"The non-finite value recorded at step {_e(step)}{f' ({where})' if where else ''}"
                f" {state}.")
    else:
        text = _origin_words(origin, event, what)
        text += (f" in an evaluation forward before step {_e(step)}."
                 if _get(event, "evaluation") is True and _get(event, "phase") != "optimizer"
                 else f" at step {_e(step)}.")
    if cause:
        text = text.rstrip(".") + f" — cause: <b>{_e(cause)}</b>."
        if str(cause) in MEANING:
            text += f' <span class="meta">({_e(MEANING[str(cause)])})</span>'
    body = f"<p>{text}</p>" + (f'<p class="hint">Hint: {_e(hint)}</p>' if hint else "")
    cls = "" if _get(report, "reproduced") else ' class="ok"'
    return f'<section id="verdict"{cls}>{body}</section>'


def _origin_words(origin: dict, event: dict, what: str) -> str:
    """The verdict's what, by which op, where, as the text report's origin line says it: the
    op of a weights origin read the bad values (it did not make them); a backward origin's
    parameters are those whose gradient went bad, not where its node ran; the micro-batch
    (of several) whose rows the samples are."""
    op, module, call = _get(origin, "op"), _get(origin, "module"), _get(origin, "call")
    param, phase = _get(origin, "param"), _get(origin, "phase")
    if isinstance(phase, str) and isinstance(_get(origin, "detail"), str) and origin["detail"]:
        # a sentence instead of an op (replay.outside: a failed decomposition, a gradient
        # entering from the loop): the text report's origin line, not an op or a parameter
        return f"{_e(phase.capitalize())}: {_e(origin['detail'].rstrip('.'))}"
    at = f" in <code>{_e(module_label(module))}</code>" if isinstance(module, str) else ""
    at += f" (call {_e(call)})" if call is not None else ""
    mb, several = _get(origin, "micro_batch"), (_num(_get(event, "micro_batches")) or 0) > 1
    at += f", {_e(forward_in_loss_phrase(mb, _get(origin, 'forward_in_loss') is True))}" \
        if isinstance(mb, int) and (mb or several) else ""
    if phase == "weights" and param:
        read_as = _get(origin, "read_as")  # (a tied parameter's name there: replay.tied_names)
        at += f" as <code>{_e(read_as)}</code>" if isinstance(read_as, str) else ""
        names = _get(origin, "aliases")
        tied = tied_text({"aliases": [str(n) for n in names]}) if isinstance(names, list) else ""
        return (f"{_e(what)} in parameter <code>{_e(param)}</code>{_e(tied)}"
                + (f", first read by <code>{_e(op)}</code>{at}" if op else ""))
    text = (f"{_e(what)} first made by <code>{_e(op)}</code>" if op
            else f"{_e(what)} first seen" + (f" during {_e(phase)}" if phase else "")) + at
    if param:
        text += (f" (the gradient of parameter <code>{_e(param)}</code>)"
                 if phase == "backward" else f" in parameter <code>{_e(param)}</code>")
    return text


def _heatmap(history: dict) -> str:
    """Layers x steps of absmax, log colour scale; non-finite red, missing grey, event boxed."""
    steps, layers = _list(history.get("steps")), _list(history.get("layers"))
    rows, skipped = _list(history.get("absmax")), _list(history.get("skipped"))
    event = history.get("event_step")
    vals = [[_num(_list(rows[s])[j]) if s < len(rows) and j < len(_list(rows[s])) else None
             for j in range(len(layers))] for s in range(len(steps))]
    pos = [v for r in vals for v in r if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (math.log10(min(pos)), math.log10(max(pos))) if pos else (0.0, 1.0)
    label_w = min(300, 16 + 6.7 * max((len(str(n)) for n in layers), default=4))
    cw = max(6.0, min(64.0, (1040 - label_w) / max(len(steps), 1)))
    ch, top = (18 if len(layers) <= 40 else 14), 22
    width, height = label_w + cw * len(steps) + 8, top + ch * len(layers) + 34
    out = [f'<svg id="heatmap" width="{width:.0f}" height="{height}" role="img" '
           f'aria-label="per-layer absmax heatmap">']
    for j, name in enumerate(layers):
        name = str(name)
        short = "(model)" if not name else name if len(name) * 6.7 + 16 <= label_w else "…" + name[-int((label_w - 22) / 6.7):]
        out.append(f'<text x="{label_w - 6:.0f}" y="{top + ch * j + ch // 2 + 3}" text-anchor="end">'
                   f"<title>{_e(name)}</title>{_e(short)}</text>")
    every = max(1, math.ceil(28 / cw))
    for s, step in enumerate(steps):
        x = label_w + cw * s
        for j, name in enumerate(layers):
            v = vals[s][j]
            if v is None:
                fill = MISSING
            elif not math.isfinite(v):
                fill = BAD
            else:
                t = (math.log10(v) - lo) / (hi - lo) if v > 0 and hi > lo else (0.0 if v <= 0 else 0.5)
                fill = _viridis(t)
            out.append(f'<rect class="cell" x="{x:.1f}" y="{top + ch * j}" width="{cw - 1:.1f}" '
                       f'height="{ch - 1}" fill="{fill}" data-layer="{_e(name)}" '
                       f'data-step="{_e(step)}" data-value="{_fmt(v)}"><title>{_e(name)} · step '
                       f"{_e(step)} · absmax {_fmt(v)}</title></rect>")
        y_lab = top + ch * len(layers) + 13
        if s % every == 0 or step == event:
            out.append(f'<text x="{x + cw / 2:.1f}" y="{y_lab}" text-anchor="middle">{_e(step)}</text>')
        if s < len(skipped) and skipped[s] in (True, 1):
            out.append(f'<text class="skipped" x="{x + cw / 2:.1f}" y="{y_lab + 14}" '
                       'text-anchor="middle" style="fill:#868e96">s<title>optimizer step '
                       "skipped</title></text>")
        if event is not None and step == event:
            out.append(f'<rect class="event-marker" x="{x - 1:.1f}" y="{top - 3}" width="{cw + 1:.1f}" '
                       f'height="{ch * len(layers) + 4}" fill="none" stroke="{EVENT}" '
                       'stroke-width="2" stroke-dasharray="4 2"/>'
                       f'<text x="{x + cw / 2:.1f}" y="{top - 7}" text-anchor="middle" '
                       f'style="fill:{EVENT};font-weight:600">event</text>')
    out.append("</svg>")
    scale = (f"{_fmt(10 ** lo)}<span class=\"grad\"></span>{_fmt(10 ** hi)}" if pos
             else "no finite positive values")
    legend = (f'<div class="legend"><span>absmax (log scale): {scale}</span>'
              f'<span><span class="sw" style="background:{BAD}"></span>inf / NaN</span>'
              f'<span><span class="sw" style="background:{MISSING}"></span>not recorded</span>'
              '<span><span class="sw" style="border:2px dashed #1c1c1c"></span>event step</span>'
              "<span>s = optimizer step skipped</span></div>")
    return legend + '<div class="scroll">' + "".join(out) + "</div>"


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0**k for k in range(math.floor(lo), math.ceil(hi) + 1) if lo <= k <= hi] or [10**lo]
    raw = (hi - lo) / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


def _line_plot(pid: str, title: str, steps: Sequence[Any], series: list[list[float | None]],
               event: Any, names: list[str] | None = None) -> str:
    """One SVG line plot; a path per series, gaps at missing or non-finite points, the latter
    marked with red ticks at the top; log y when finite positive values span > 2 decades."""
    W, H, L, R, T, B = 1070, 170, 64, 12, 24, 26
    xs = [_num(s) for s in steps]
    if any(x is None or not math.isfinite(x) for x in xs):
        xs = [float(i) for i in range(len(steps))]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    x0, x1 = (x0 - 0.5, x1 + 0.5) if x1 - x0 < 1 else (x0, x1)
    fin = [v for s in series for v in s if v is not None and math.isfinite(v)]
    log = bool(fin) and min(fin) > 0 and max(fin) / min(fin) > 100
    tr = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo, hi = (tr(min(fin)), tr(max(fin))) if fin else (0.0, 1.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = 0.5 if log else max(abs(hi) * 0.1, 1e-12)
        lo, hi = lo - pad, hi + pad
    lo, hi = lo - 0.06 * (hi - lo), hi + 0.06 * (hi - lo)

    def px(x: float) -> float:
        return L + (x - x0) / (x1 - x0) * (W - L - R)

    def py(v: float) -> float:
        return T + (hi - tr(v)) / (hi - lo) * (H - T - B)

    out = [f'<svg id="{pid}" width="{W}" height="{H}" role="img" aria-label="{_e(title)}">',
           f'<text class="title" x="{L}" y="15">{_e(title)}{" (log scale)" if log else ""}</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="#fff" stroke="#dee2e6"/>']
    for t in _ticks(lo, hi, log) if fin else []:
        y = py(t)
        out.append(f'<line x1="{L}" x2="{W - R}" y1="{y:.1f}" y2="{y:.1f}" stroke="#f1f3f5"/>'
                   f'<text x="{L - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    every = max(1, math.ceil(len(steps) / 16))
    for i, s in enumerate(steps):
        last = i == len(steps) - 1
        if last or (i % every == 0 and len(steps) - 1 - i >= every / 2):
            out.append(f'<text x="{px(xs[i]):.1f}" y="{H - 8}" text-anchor="middle">{_e(s)}</text>')
    if event is not None and event in steps:
        x = px(xs[list(steps).index(event)])
        out.append(f'<line class="event-line" x1="{x:.1f}" x2="{x:.1f}" y1="{T}" y2="{H - B}" '
                   f'stroke="{EVENT}" stroke-width="1.5" stroke-dasharray="5 3"><title>event step '
                   f"{_e(event)}</title></line>")
    for k, vals in enumerate(series or [[]]):
        name = names[k] if names and k < len(names) else title
        out.append(_series(vals[: len(xs)], [px(x) for x in xs], steps, py, log, T, name,
                           SERIES[k % len(SERIES)]))
    if not fin:
        out.append(f'<text x="{(L + W) / 2}" y="{(T + H - B) / 2 + 4}" text-anchor="middle">'
                   "no finite values recorded</text>")
    if names and len(names) > 1:
        for k, n in enumerate(names):
            out.append(f'<text x="{W - R - 110 * (len(names) - k)}" y="15" '
                       f'style="fill:{SERIES[k % len(SERIES)]}">■ {_e(n)}</text>')
    return "".join(out) + "</svg>"


def _series(vals: list[float | None], xs: list[float], steps: Sequence[Any], py, log: bool,
            top: float, name: str, colour: str) -> str:
    """One series' path (gaps at missing or non-finite points, the latter as red ticks at the
    ``top``) at x positions ``xs``, ``py`` mapping a value to y."""
    out, d, pen = [], [], "M"
    for i, v in enumerate(vals):
        if v is None or not math.isfinite(v) or (log and v <= 0):
            pen = "M"
            if v is not None and not math.isfinite(v):
                out.append(f'<path class="nonfinite" d="M{xs[i] - 4:.1f} {top + 1}h8l-4 7z" '
                           f'fill="{BAD}"><title>step {_e(steps[i])}: {_fmt(v)}</title></path>')
            continue
        d.append(f"{pen}{xs[i]:.1f} {py(v):.1f}")
        pen = "L"
    out.append(f'<path class="series" data-series="{_e(name)}" d="{" ".join(d)}" fill="none" '
               f'stroke="{colour}" stroke-width="1.8" stroke-linejoin="round"/>')
    if len(d) == 1:  # a lone point has no line: draw a dot
        out.append(f'<circle cx="{d[0][1:].split()[0]}" cy="{d[0].split()[1]}" r="2.5" '
                   f'fill="{colour}"/>')
    return "".join(out)


def _plots(history: dict) -> str:
    steps, event = _list(history.get("steps")), history.get("event_step")
    lr_rows = [_list(r) if isinstance(r, (list, tuple)) else [r] for r in _list(history.get("lr"))]
    groups = max((len(r) for r in lr_rows), default=0)
    lr = [[_num(r[g]) if g < len(r) else None for r in lr_rows] for g in range(max(groups, 1))]
    names = [f"group {g}" for g in range(groups)] if groups > 1 else None
    parts = [_line_plot("plot-loss", "loss", steps, [[_num(v) for v in _list(history.get("loss"))]], event),
             _line_plot("plot-grad-norm", "gradient norm", steps,
                        [[_num(v) for v in _list(history.get("grad_norm"))]], event),
             _line_plot("plot-lr", "learning rate", steps, lr, event, names)]
    legend = (f'<div class="legend"><span><span class="sw" style="background:{BAD}"></span>'
              "non-finite value (not drawn)</span><span><span class=\"sw\" "
              'style="border:2px dashed #1c1c1c"></span>event step</span></div>')
    return legend + "".join(f'<div class="scroll">{p}</div>' for p in parts)


def _source(report: dict, src: Any) -> str:
    line = _get(report, "source_lines", str(src)) if src else None
    return f"<pre>{_e(src)}:  {_e(str(line).strip())}</pre>" if line else ""


def _origin(report: dict) -> str:
    origin, event = _get(report, "origin"), _get(report, "event") or {}
    if not isinstance(origin, dict) or not origin:
        return ('<section id="origin"><p class="none">No origin: the replay did not find where the '
                f"value was made (recorded at step {_e(_get(event, 'step'))}, "
                f"{_e(_get(event, 'phase'))}, {_e(_get(event, 'module'))}).</p></section>")
    rows = []
    for key in ("phase", "module", "call", "op", "param", "tensor", "samples", "source"):
        v = origin.get(key)
        if key == "samples" and origin.get("all_samples") is True and _list(v):
            v = f"all {len(_list(v))} rows"
        if isinstance(v, (list, tuple)):
            v = ", ".join(str(x) for x in v) or None
        if key == "module":
            v = module_label(v)
        cell = f"<code>{_e(v)}</code>" if v is not None else '<span class="none">—</span>'
        rows.append(f"<tr><th>{key}</th><td>{cell}</td></tr>")
    out = [f'<section id="origin"><table>{"".join(rows)}</table>{_source(report, origin.get("source"))}']
    chain = [c for c in _list(origin.get("chain")) if isinstance(c, dict)]
    if chain:
        out.append("<h2>Chain</h2><table><tr><th>#</th><th>op</th><th>made</th><th>source</th></tr>")
        for i, c in enumerate(chain):
            line = _get(report, "source_lines", str(c.get("source")))
            code = f"<br><code>{_e(str(line).strip())}</code>" if line else ""
            out.append(f"<tr><td>{i}</td><td><code>{_e(c.get('op'))}</code></td><td>{_e(c.get('made'))}"
                       f"</td><td><code>{_e(c.get('source'))}</code>{code}</td></tr>")
        out.append("</table>")
    return "".join(out) + "</section>"


def _precursors(report: dict) -> str:
    items = [p for p in _list(_get(report, "precursors")) if isinstance(p, dict)]
    if not items:
        return '<section id="precursors"><p class="none">No precursors flagged.</p></section>'
    rows = "".join(f"<tr><td>{_e(p.get('step'))}</td><td><code>{_e(p.get('kind'))}</code></td>"
                   f"<td>{_e(p.get('detail'))}</td></tr>" for p in items)
    return (f'<section id="precursors"><table><tr><th>step</th><th>kind</th><th>detail</th></tr>'
            f"{rows}</table></section>")


def _bisection(report: dict) -> str:
    b = _get(report, "bisection")
    if not isinstance(b, dict):
        return '<section id="bisection"><p class="none">No bisection was run.</p></section>'
    agrees = {True: "yes", False: "<b>no</b>"}.get(b.get("agrees"), _e(b.get("agrees")))
    # (the text report's words: the bisection's module call against the instrumented pass's)
    return (f'<section id="bisection"><p>{_e(b.get("probes"))} probe(s); agrees with the '
            f"instrumented pass: {agrees}.</p></section>")


def _ranks(report: dict) -> str:
    """The text report's ``rank`` line (which rank's step this is), as a paragraph."""
    from .report import rank_lines

    try:
        lines = rank_lines(report)
    except (AttributeError, TypeError):  # (a hand-made report without these keys)
        return ""
    return "".join(f'<p class="meta">{_e(s.strip()[len("rank"):].strip())}</p>' for s in lines)


def _details(report: dict) -> str:
    """The text report's lines that no other section shows (``replay.report.detail_lines``:
    the notes, who read corrupted weights, a replay that ran differently, ...), as a table."""
    from .report import detail_lines

    try:
        pairs = detail_lines(report)
    except (AttributeError, KeyError, TypeError):  # (a hand-made report without these keys)
        return ""
    if not pairs:
        return ""
    rows = "".join(f"<tr><th>{_e(label)}</th><td>{_e(text)}</td></tr>" for label, text in pairs)
    return f'<h2>Notes</h2><section id="notes"><table>{rows}</table></section>'


def render_html(report: dict, history: dict) -> str:
    """Render the report and the ring-buffer history as one self-contained HTML document."""
    report = report if isinstance(report, dict) else {}
    history = history if isinstance(history, dict) else {}
    bundle = _get(report, "bundle") or {}
    meta = " · ".join(f"{k} {_e(bundle.get(k))}" for k in ("path", "rank", "torch")
                      if isinstance(bundle, dict) and bundle.get(k) is not None)
    has_history = bool(_list(history.get("steps")))
    note = "" if has_history else '<p class="none">This bundle holds no ring-buffer history.</p>'
    ring = (f"{note}<h3>Per-layer absmax</h3>{_heatmap(history)}"
            f"<h3>Loss, gradient norm and learning rate</h3>{_plots(history)}")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>nanreplay report — step {_e(_get(report, "event", "step"))}</title>
<style>{STYLE}</style></head>
<body><main>
<h1>nanreplay report</h1><div class="meta">{meta} · {_e(_get(report, "format"))}</div>
{_ranks(report)}{_verdict(report)}{_details(report)}
<h2>Ring buffer ({len(_list(history.get("steps")))} recorded steps)</h2><section>{ring}</section>
<h2>Origin</h2>{_origin(report)}
<h2>Precursors</h2>{_precursors(report)}
<h2>Bisection</h2>{_bisection(report)}
{window_html(report, _e)}{what_if_html(report, _e)}
</main></body></html>
"""
