"""The HTML report of real bundles: the toy example's training, recorded with the loop's own
forward hooks measuring every module's largest absolute output, then ``nanreplay --html``.

The page's heatmap must hold, for every recorded step and layer, the value the loop measured
(to the 3 significant digits the page shows), NaN where the planted bug struck, the event
marked; headless Chromium renders the same cells. A copy stripped of batch and weights is not
re-run, but its page still shows the ring buffer's history, the same cells.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from bundles import EXAMPLES, TOY_REPORT
from bundles import invoke_cli as run
from test_html_report import Elements, run_chromium, section_text
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

EVENT_STEP = 37
VERDICT = "NaN first made by aten.div in norm (call 0) at step 37 — cause: invalid."


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, dict[tuple[str, int], float]]:
    """The toy example's loop under the recorder; returns its bundle and, per (layer, step),
    the largest absolute output the loop itself saw."""
    saved = list(sys.path)
    sys.path.insert(0, str(EXAMPLES))
    try:
        from toy_model import make_model
        from train_toy import batches
    finally:
        sys.path[:] = saved
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    crit = nn.CrossEntropyLoss()
    seen: dict[tuple[str, int], float] = {}
    step = [0]

    def measure(name):
        def hook(module, args, out):
            key = (name, step[0])  # the page names the root ""
            v, prev = out.detach().abs().max().item(), seen.get(key)
            # a layer called twice in a step: its largest value, NaN if any call made one
            seen[key] = v if prev is None or math.isnan(v) or (v > prev and
                                                                not math.isnan(prev)) else prev
        return hook

    handles = [m.register_forward_hook(measure(n)) for n, m in model.named_modules()]
    out = tmp_path_factory.mktemp("html-real")
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out / "bundles",
                            factory="toy_model:make_model"):
            for step[0], (x, y) in enumerate(batches(100)):
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    except NonFiniteError as e:
        return Path(e.bundle_path), seen
    finally:
        for h in handles:
            h.remove()
    raise AssertionError("the toy example's planted NaN did not fire")


def cells(page: str) -> dict[tuple[str, int], str]:
    return {(c["data-layer"], int(c["data-step"])): c["data-value"]
            for c in Elements(page).find("rect", "cell", "heatmap")}


@pytest.fixture
def in_examples(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)


def test_the_page_shows_the_history_the_loop_measured(recorded, in_examples, tmp_path):
    bundle, seen = recorded
    page_path = tmp_path / "report.html"
    r = run(bundle, "--html", page_path)
    assert r.exit_code == 0, r.stdout + r.stderr
    assert r.stdout.rstrip("\n").splitlines() == TOY_REPORT
    page = page_path.read_text(encoding="utf-8")
    assert VERDICT in section_text(page, "verdict")
    got = cells(page)
    # every layer the loop saw, but the containers that pass an inner call's output through
    # (the toy's plain Sequential 'encoder': recorded as no call, its rows would repeat one)
    passing = set(read_bundle(bundle)[0]["passthrough_modules"])
    assert passing == {"encoder"}
    layers = {layer for layer, _ in seen} - passing
    assert set(got) == {(layer, s) for layer in layers for s in range(EVENT_STEP + 1)}
    for (layer, s), value in got.items():
        expected = seen[layer, s]
        assert value == ("nan" if math.isnan(expected) else format(expected, ".3g")), \
            (layer, s, value, expected)
    assert got["norm", EVENT_STEP] == "nan" and got["norm", EVENT_STEP - 1] != "nan"
    els = Elements(page)
    assert len(els.find("rect", "event-marker", "heatmap")) == 1
    for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
        assert len(els.find("line", "event-line", pid)) == 1
    assert len(els.find("path", "series", "plot-lr")) == 1  # one parameter group
    assert len(els.find("path", "nonfinite", "plot-loss")) == 1  # the NaN loss of step 37

    dom = run_chromium(page_path.as_uri(), "--dump-dom", profile=tmp_path / "profile")
    assert cells(dom) == got
    assert VERDICT in section_text(dom, "verdict")


def test_html_of_a_stripped_copy_shows_the_same_history(recorded, in_examples, tmp_path):
    bundle, _ = recorded
    full, share = tmp_path / "full.html", tmp_path / "share.html"
    assert run(bundle, "--html", full).exit_code == 0
    stripped = tmp_path / "share.nan"
    s = run(bundle, "--strip", "batch", "--strip", "weights", "-o", stripped)
    assert s.exit_code == 0, s.stdout + s.stderr
    r = run(stripped, "--html", share)
    assert r.exit_code == 1, r.stdout + r.stderr
    assert "  note       the batch and the weights were stripped from this bundle" in \
        r.stdout.splitlines()
    page = share.read_text(encoding="utf-8")
    assert cells(page) == cells(full.read_text(encoding="utf-8")) != {}
    assert "not re-run (batch and weights stripped)" in section_text(page, "verdict")
    # the page says why, as the text report does, and Chromium shows it
    note = "notethe batch and the weights were stripped from this bundle"
    assert note in section_text(page, "notes")
    assert 'id="notes"' not in full.read_text(encoding="utf-8")  # (the full one has none)
    dom = run_chromium(share.as_uri(), "--dump-dom", profile=tmp_path / "profile")
    assert note in section_text(dom, "notes")
    els = Elements(page)
    for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
        assert els.find("path", "series", pid), pid
        assert len(els.find("line", "event-line", pid)) == 1
