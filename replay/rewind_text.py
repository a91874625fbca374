"""The rewind window's and the ``--try`` what-ifs' words: the text report's ``window``,
``first``, ``began`` and ``what-if`` lines and the HTML page's two sections, from a report
alone (no torch here, as for the rest of the page).
"""

from __future__ import annotations

from typing import Any

from .cause_text import module_label
from .diverging import beyond_text, diverging_text


def where(o: dict[str, Any] | None) -> str:
    """``update of emb.weight (aten.addcdiv_)``, ``forward, head call 0``."""
    if not o:
        return ""
    if o["phase"] in ("update", "backward"):
        params = o.get("params") or []
        more = f" (+{len(params) - 1} more)" if len(params) > 1 else ""
        what = f"{o['phase']} of {params[0]}{more}" if params else o["phase"]
    else:
        mod = module_label(o.get("module"))
        call = f" call {o['call']}" if o.get("call") is not None else ""
        what = f"{o['phase']}, {mod}{call}" if mod is not None else o["phase"]
        if o.get("micro_batch"):  # (another micro-batch than the first: say which)
            what += f", micro-batch {o['micro_batch']}"
    return what + (f" ({o['op']})" if o.get("op") else "") + (
        f" (its {o['state']})" if o.get("state") else "")


def window_lines(report: dict[str, Any]) -> list[str]:
    w = report.get("window")
    if not w:
        return []
    first, last = w["steps"]
    got = ("the event came back at the recorded step" if w["reproduced"] else
           f"first non-finite at step {w['event_step']}, not the recorded event"
           if w["event_step"] is not None else "every value finite: the event did NOT come back")
    clip = w.get("loop_clip")  # (the re-run applies the loop's own gradient clipping too)
    got += f" (the loop's gradient clipping to norm {clip:.4g} re-applied)" if clip else \
        " (the loop's zeroing of gradients whose norm overflowed re-applied)" \
        if w.get("loop_zeroes") else ""
    lines = [f"  window     steps {first}-{last} re-run from the copy at step {w['copy_step']}: "
             f"{got}"]
    f = w.get("first_non_finite")
    if f:
        lines.append(f"  first      step {f['step']}: {f.get('kind') or 'non-finite'} in the "
                     f"{where(f)}")
    b = w.get("precursors_began")
    if b:
        lines.append(f"  began      step {b['step']}: {b['detail']}")
    return lines


def what_if_lines(report: dict[str, Any]) -> list[str]:
    return [f"  what-if    {t['try']:<14} {what_if_verdict(t)}"
            for t in report.get("what_if") or []]


def what_if_verdict(t: dict[str, Any]) -> str:
    """One try's verdict, in the text report's and the HTML page's words alike: how far it was
    re-run, why it was not, what it raised."""
    if t.get("error"):
        verdict = f"failed: the re-run with this change raised {t['error']}"
    elif t.get("finite") is None:
        verdict = ("cannot tell: " if t.get("ran") else "not re-run: ") + str(t.get("note"))
    elif t["finite"]:  # (with the loss there: finite is not yet trained well)
        verdict = f"finite through step {t['steps'][1]}"
        if t.get("loss") is not None:
            d, wide = t.get("diverging"), t.get("beyond")
            verdict += (f" (loss {t['loss']:.4g}{diverging_text(d) if d else ''}"
                        f"{beyond_text(wide) if wide else ''})")
    else:
        o = t["origin"]
        verdict = f"{o.get('kind') or 'non-finite'} at step {o['step']} ({where(o)})"
    if t.get("inconclusive"):
        verdict = (f"inconclusive: {verdict}; the unchanged re-run is finite too: this try "
                   "proves nothing" if t["finite"] else
                   f"inconclusive: {verdict}; the unchanged re-run is finite: the change "
                   "made it, not the recorded event")
    if t.get("note") and t.get("finite") is not None:  # what the re-run could not do
        verdict += f"; {t['note']}"
    return verdict


def window_html(report: dict[str, Any], esc) -> str:
    lines = window_lines(report)
    if not lines:
        return ""
    return "<h2>Rewind window</h2><pre>" + esc("\n".join(s.strip() for s in lines)) + "</pre>"


def what_if_html(report: dict[str, Any], esc) -> str:
    rows = report.get("what_if") or []
    if not rows:
        return ""
    body = "".join(f"<tr><td><code>{esc(t['try'])}</code></td><td>{esc(what_if_verdict(t))}"
                   "</td></tr>" for t in rows)
    return ("<h2>What if</h2><table class=\"whatif\"><tr><th>try</th><th>result</th></tr>"
            f"{body}</table>")
