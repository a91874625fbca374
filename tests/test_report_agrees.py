"""The text report, the ``--json`` report and the HTML page of one bundle say the same thing:
the step, the phase, what was made (nan, +inf, -inf), the op, the module call and its
micro-batch, the samples ("all N rows" where they are the whole batch), the cause and whether
the step was re-run. Each bundle comes from a planted bug in a real training loop; the
expected fields are derived from the plant, and the three renderings are compared field by
field with ``agree``.
"""

from __future__ import annotations

import html
import json
import re

import agree_models as A
import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

LABELS = {"nan": "NaN", "+inf": "Inf", "-inf": "-Inf"}


def _reports(bundle, tmp_path, *args) -> tuple[str, dict, str]:
    """(text, JSON, the HTML page's verdict as plain text) of one bundle."""
    page = tmp_path / "report.html"
    text = invoke_cli(bundle, "--html", page, *args)
    js = invoke_cli(bundle, "--json", *args)
    assert text.exit_code == js.exit_code and text.exit_code in (0, 1), text.stderr + js.stderr
    verdict = re.search(r'<section id="verdict".*?</p>', page.read_text(), re.S).group(0)
    return text.stdout, json.loads(js.stdout), html.unescape(re.sub(r"<[^>]+>", "", verdict))


def agree(text: str, rep: dict, verdict: str) -> None:
    """Every field the text report and the HTML verdict print equals the JSON's."""
    ev, o = rep["event"], rep["origin"]
    lines = {ln[2:13].strip(): ln[13:] for ln in text.splitlines()[1:]}
    state = ("reproduced" if rep["reproduced"] else f"not re-run ({rep['not_rerun']})"
             if rep["not_rerun"] else "NOT reproduced")
    when = (f"evaluation forward before step {ev['step']}" if ev.get("evaluation")
            else f"step {ev['step']}")
    assert text.splitlines()[0] == f"nanreplay: {when}, {ev['phase']} event — {state}"
    assert rep["reproduced"] is False or rep["not_rerun"] is None, rep["not_rerun"]
    line = lines["origin"]
    assert line.startswith(f"{o['phase']}: {o['made']} made by "), (line, o)
    several = (ev.get("micro_batches") or 0) > 1
    mb = f", micro-batch {o['micro_batch']}" if o["micro_batch"] or several else ""
    assert (mb in line) and (mb or ", micro-batch" not in line), (line, mb)
    if o["phase"] not in ("weights", "optimizer"):
        assert f"{o['op']} in " in line if o["op"] else " in " not in line.split(" made by ")[1]
        assert o["module"] is None or f" {o['module']}" in line, line
        assert o["call"] is None or f", call {o['call']}" in line, line
    s = o["samples"]
    more = f" (+{len(s) - 16})" if len(s) > 16 else ""
    assert lines.get("samples") == (f"all {len(s)} rows" if o["all_samples"] and len(s) > 1
                                    else f"{s[:16]}{more}" if s else None)
    _window_agrees(text, rep)
    assert lines["cause"].startswith(f"{rep['cause'] or 'unknown'} — ")
    if not rep["reproduced"]:
        assert (f"not re-run ({rep['not_rerun']})" if rep["not_rerun"] else
                "not reproduced") in verdict, verdict
        return
    assert verdict.startswith(LABELS[o["made"]]) and f"cause: {rep['cause']}." in verdict
    assert (mb in verdict) and re.search(rf"\bstep {ev['step']}\b", verdict), verdict
    if o["phase"] == "weights":  # (its op read the bad values; the parameter held them)
        assert f"in parameter {o['params'][0]}, first read by {o['op']}" in verdict, verdict
    elif o["op"]:
        assert f"first made by {o['op']}" in verdict, verdict


def _window_agrees(text: str, rep: dict) -> None:
    """The window's and the what-ifs' lines say the JSON's steps, kinds and verdicts."""
    lines = text.splitlines()
    w, tries = rep.get("window"), rep.get("what_if") or []
    said = [ln for ln in lines if ln.startswith("  window ")]
    assert len(said) == (1 if w else 0), said
    if w:
        first, last = w["steps"]
        assert said[0].startswith(f"  window     steps {first}-{last} re-run from the copy at "
                                  f"step {w['copy_step']}: "), said
        assert ("the event came back" in said[0]) == w["reproduced"], (said, w["reproduced"])
        f = w["first_non_finite"]
        firsts = [ln for ln in lines if ln.startswith("  first ")]
        assert firsts == ([f"  first      step {f['step']}: {f['kind']} in the "
                           f"{firsts[0].split(' in the ', 1)[1]}"] if f else []), firsts
    whats = [ln[13:] for ln in lines if ln.startswith("  what-if ")]
    assert [ln.split()[0] for ln in whats] == [t["try"] for t in tries], whats
    for ln, t in zip(whats, tries):
        o = t.get("origin")
        assert (f"{o['kind']} at step {o['step']} (" in ln) if o else "nan at" not in ln, (ln, t)


def _train(model, opt, out_dir, factory, steps, plant, micro=1, **kw):
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw):
            for s in range(steps):
                opt.zero_grad()
                for m in range(micro):
                    x, y = plant(s, m, model)
                    (crit(model(x), y) / micro).backward()
                opt.step()
    return info.value.bundle_path


def test_accumulated_micro_batch_is_named_alike_in_text_json_and_html(out_dir, tmp_path):
    """Three micro-batches per step; row 3 of micro-batch 2 of step 2 is constant, so the
    normaliser's std is 0 there: 0/0 in aten.div, those rows of that micro-batch. The HTML
    verdict left out the micro-batch the text names (its samples index that micro-batch's
    rows), and its bisection section said "agrees with the recorded event" where the text
    says "agrees with the instrumented pass"."""
    step, mb, row = 2, 2, 3

    def plant(s, m, model):
        x, y = A.batch(10 * s + m)
        if (s, m) == (step, mb):
            x[row] = 1.0
        return x, y

    torch.manual_seed(0)
    model = A.make_normed()
    bundle = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), out_dir,
                    "agree_models:make_normed", 4, plant, micro=3)
    text, rep, verdict = _reports(bundle, tmp_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["made"], o["op"], o["module"], o["call"],
            o["micro_batch"], o["samples"], rep["cause"]) == \
        (step, "forward", "nan", "aten.div", "norm", 0, mb, [row], "invalid")
    agree(text, rep, verdict)
    page = (tmp_path / "report.html").read_text()
    assert "agrees with the instrumented pass: yes" in page


def test_weights_written_between_steps_say_what_they_hold_and_who_read_them(out_dir, tmp_path):
    """The loop writes NaN into fc1.weight[0, 0] before step 3; every sample's column 0 is
    non-zero, so all rows read it. The JSON origin's ``made`` was null where the text said
    nan, and the HTML verdict said "first made by aten.addmm": that op read the values."""
    at = 3

    def plant(s, m, model):
        if s == at:
            with torch.no_grad():
                model.fc1.weight[0, 0] = float("nan")
        return A.batch(s)

    torch.manual_seed(0)
    model = A.make_mlp()
    bundle = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), out_dir,
                    "agree_models:make_mlp", 5, plant)
    text, rep, verdict = _reports(bundle, tmp_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["made"], o["params"], o["op"], o["module"],
            o["samples"], rep["cause"]) == \
        (at, "weights", "nan", ["fc1.weight"], "aten.addmm", "fc1", list(range(A.BATCH)),
         "weights")
    agree(text, rep, verdict)


def test_an_update_the_window_re_ran_is_not_also_not_re_run(out_dir, tmp_path):
    """Adam(eps=0) at step 0 makes 0/0 in the embedding rows of tokens 8-15, which no batch
    holds until step 3; recorded with rewind=2, the window re-runs the update. The text said
    "reproduced" while the JSON said both ``reproduced: true`` and ``not_rerun: "the bundle
    holds the weights after the update"``."""
    seen, late = 8, 3

    def plant(s, m, model):
        return A.token_batch(s, A.TOKENS if s >= late else seen)

    torch.manual_seed(0)
    model = A.make_tokens()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    bundle = _train(model, opt, out_dir, "agree_models:make_tokens", 6, plant, rewind=2)
    text, rep, verdict = _reports(bundle, tmp_path)
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["made"], o["op"], o["params"], rep["cause"],
            rep["reproduced"], rep["not_rerun"]) == \
        (0, "optimizer", "nan", "aten.addcdiv_", ["emb.weight"], "optimizer", True, None)
    assert o.get("rows") == list(range(seen, A.TOKENS)), o.get("rows")
    agree(text, rep, verdict)
