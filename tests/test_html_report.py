"""Tests of replay.html: pure-Python checks of the markup, then real headless Chromium.

The Chromium tests need Debian's ``chromium`` (the CI installs it); without it they fail, not skip.
They load the page from ``file://`` and (1) dump the DOM, (2) take a screenshot, (3) route every
request through a local recording proxy and assert it saw none, with a positive control that
does reference an external image and must reach the proxy.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from replay.html import CSP, render_html

EVIL = "<script>alert(1)</script>"
LAYERS = ["embed", "encoder.0.linear", "encoder.0.act", "encoder.1.linear", "encoder.2.act", "head"]
STEPS = [1, 2, 3, 4, 5, 6, 7]


def make_report(**over: Any) -> dict:
    report = {
        "format": "nanreplay-report/1",
        "bundle": {"path": "runs/a/step6-rank0.nan", "rank": 0, "torch": "2.13.0"},
        "event": {"step": 6, "phase": "forward", "module": "encoder.2.act"},
        "reproduced": True,
        "origin": {"phase": "forward", "module": "encoder.2.act", "call": 0, "op": "aten.log",
                   "param": None, "tensor": None, "samples": [5], "source": "model.py:42",
                   "chain": [{"op": "aten.log", "made": "nan", "source": "model.py:42"}]},
        "cause": "invalid",
        "hint": "log of a negative input; clamp it.",
        "precursors": [{"step": 5, "kind": "lr_jump", "detail": "lr x10"}],
        "bisection": {"probes": 5, "agrees": True},
        "source_lines": {"model.py:42": "    x = torch.log(h)"},
    }
    report.update(over)
    return report


def make_history(**over: Any) -> dict:
    absmax = [[10.0 ** (j - 2 + 0.2 * i) for j in range(len(LAYERS))] for i in range(len(STEPS))]
    absmax[5][4:] = [math.nan, math.inf]
    absmax[6][4:] = [-math.inf, None]
    hist = {
        "steps": STEPS,
        "loss": [2.3, 2.1, 1.9, 1.8, 1.9, math.nan, None],
        "grad_norm": [1.0, 0.9, 1.2, 0.8, 30.0, math.inf, math.nan],
        "param_norm": [10.0] * 7,
        "lr": [[1e-5 * 10**i, 1e-6] for i in range(5)] + [[1e-1, 1e-6], [1e-1, 1e-6]],
        "layers": LAYERS,
        "absmax": absmax,
        "event_step": 6,
        "skipped": [False] * 6 + [True],
    }
    hist.update(over)
    return hist


class Elements(HTMLParser):
    """Every start tag as (tag, attrs, id of the enclosing <svg>), plus the text by top id."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None], str | None]] = []
        self._svg: list[str | None] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.elements.append((tag, a, self._svg[-1] if self._svg else None))
        if tag == "svg":
            self._svg.append(a.get("id"))

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg" and self._svg:
            self._svg.pop()

    def find(self, tag: str | None = None, cls: str | None = None, svg: str | None = None) -> list:
        return [a for t, a, s in self.elements if (tag is None or t == tag)
                and (cls is None or cls in (a.get("class") or "").split())
                and (svg is None or s == svg)]

    def ids(self) -> list[str]:
        return [a["id"] for _, a, _ in self.elements if a.get("id")]


def section_text(page: str, sid: str) -> str:
    m = re.search(rf'<section id="{sid}"[^>]*>(.*?)</section>', page, re.S)
    assert m, f"no section #{sid}"
    return unescape(re.sub(r"<[^>]+>", "", m.group(1)))


# ---------------------------------------------------------------- pure Python


def test_structure_ids_and_order() -> None:
    page = render_html(make_report(), make_history())
    assert page.startswith("<!DOCTYPE html>")
    ids = Elements(page).ids()
    order = ["verdict", "heatmap", "plot-loss", "plot-grad-norm", "plot-lr", "origin", "precursors"]
    assert [i for i in ids if i in order] == order
    verdict = section_text(page, "verdict")
    assert "NaN first made by aten.log in encoder.2.act (call 0) at step 6 — cause: invalid." in verdict
    assert "Hint: log of a negative input; clamp it." in verdict
    origin = section_text(page, "origin")
    assert "x = torch.log(h)" in origin and "model.py:42" in origin
    assert "lr_jump" in section_text(page, "precursors")
    assert "5 probe(s)" in section_text(page, "bisection")


def test_verdict_of_an_evaluation_forward() -> None:
    report = make_report(event={"step": 6, "phase": "forward", "module": "encoder.2.act",
                                "evaluation": True})
    verdict = section_text(render_html(report, make_history()), "verdict")
    assert "(call 0) in an evaluation forward before step 6 — cause: invalid." in verdict


def test_notes_show_the_text_reports_other_lines() -> None:
    # what the text report says beyond the verdict and the origin: who read the corrupted
    # weights, a replay that ran differently, the notes; a bundle's strings stay escaped
    report = make_report(
        origin={"phase": "weights", "module": "emb", "op": "aten.embedding",
                "params": ["emb.weight"], "coupled": [5, 9], "samples": [5],
                "anomaly_node": "EmbeddingBackward0"},
        problems=["the loss was not called through rec.loss_fn", EVIL])
    page = render_html(report, make_history())
    notes = section_text(page, "notes")
    for label, line in (("read by", "aten.embedding in emb, first in the forward"),
                        ("anomaly", "detect_anomaly names EmbeddingBackward0"),
                        ("note", "the loss was not called through rec.loss_fn"),
                        ("note", EVIL)):
        assert f"{label}{line}" in notes, notes
    assert EVIL not in page  # (escaped)
    assert "coupled[9]: the loss combines" in notes
    # a report without any of them has no notes section
    assert 'id="notes"' not in render_html(make_report(), make_history())


def test_strings_are_escaped() -> None:
    attr = '" onmouseover="alert(2)'
    report = make_report(
        bundle={"path": EVIL, "rank": EVIL, "torch": EVIL},
        event={"step": EVIL, "phase": EVIL, "module": EVIL},
        origin={"phase": EVIL, "module": EVIL, "call": EVIL, "op": EVIL, "param": EVIL,
                "tensor": EVIL, "samples": [EVIL], "source": EVIL,
                "chain": [{"op": EVIL, "made": EVIL, "source": EVIL}]},
        cause=EVIL, hint=EVIL, precursors=[{"step": EVIL, "kind": EVIL, "detail": EVIL}],
        bisection={"probes": EVIL, "agrees": EVIL}, source_lines={EVIL: EVIL},
        format=EVIL)
    history = make_history(layers=[EVIL, attr] + LAYERS[2:], steps=[EVIL] + STEPS[1:])
    page = render_html(report, history)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    els = Elements(page)
    assert not [a for _, a, _ in els.elements if "onmouseover" in a]
    cells = els.find("rect", "cell", "heatmap")
    assert {c["data-layer"] for c in cells} >= {EVIL, attr}  # round-trips as data, not markup
    assert EVIL in {c["data-step"] for c in cells}


def test_no_external_references() -> None:
    page = render_html(make_report(), make_history())
    csp = f'<meta http-equiv="Content-Security-Policy" content="{CSP}"'.replace("'", "&#x27;")
    assert csp in page
    assert CSP == "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    low = page.lower()
    for bad in ("http://", "https://", "//cdn", "xmlns", "url(", "@import", "src=", "href=",
                "<link", "<img", "<iframe", "<object", "<script"):
        assert bad not in low, bad


def test_heatmap_cells() -> None:
    hist = make_history()
    els = Elements(render_html(make_report(), hist))
    cells = els.find("rect", "cell", "heatmap")
    assert len(cells) == len(LAYERS) * len(STEPS)
    assert {(c["data-layer"], c["data-step"]) for c in cells} == {
        (layer, str(s)) for layer in LAYERS for s in STEPS}
    # ragged / short rows still give one cell per (layer, step), missing ones "none"
    ragged = make_history(absmax=[[1.0], [], [2.0, 3.0]])
    cells = Elements(render_html(make_report(), ragged)).find("rect", "cell", "heatmap")
    assert len(cells) == len(LAYERS) * len(STEPS)
    assert sum(c["data-value"] == "none" for c in cells) == len(cells) - 3
    # the event column is marked, in the heatmap and in each line plot
    assert len(els.find("rect", "event-marker", "heatmap")) == 1
    for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
        assert len(els.find("line", "event-line", pid)) == 1


def test_non_finite_values() -> None:
    page = render_html(make_report(), make_history())
    els = Elements(page)
    by = {(c["data-layer"], c["data-step"]): c for c in els.find("rect", "cell", "heatmap")}
    assert by[("encoder.2.act", "6")]["data-value"] == "nan"
    assert by[("head", "6")]["data-value"] == "inf"
    assert by[("encoder.2.act", "7")]["data-value"] == "-inf"
    assert by[("head", "7")]["data-value"] == "none"
    red = {by[k]["fill"] for k in [("encoder.2.act", "6"), ("head", "6"), ("encoder.2.act", "7")]}
    assert len(red) == 1 and red != {by[("head", "7")]["fill"]} and red != {by[("embed", "1")]["fill"]}
    assert "inf / NaN" in page  # legend
    # the line plots skip non-finite points, mark them, and never write nan/inf coordinates
    assert len(els.find("path", "nonfinite", "plot-loss")) == 1
    assert len(els.find("path", "nonfinite", "plot-grad-norm")) == 2
    for _, a, _ in els.elements:
        for k in ("x", "y", "x1", "x2", "y1", "y2", "width", "height", "d", "cx", "cy"):
            assert not re.search(r"nan|inf", a.get(k) or "", re.I), (k, a)
    for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
        assert all(p["d"].startswith("M") for p in els.find("path", "series", pid))


def test_log_scale_and_lr_groups() -> None:
    page = render_html(make_report(), make_history())
    els = Elements(page)
    assert len(els.find("path", "series", "plot-lr")) == 2  # one per param group
    svg = {pid: re.search(rf'<svg id="{pid}".*?</svg>', page, re.S).group(0)  # type: ignore[union-attr]
           for pid in ("plot-loss", "plot-grad-norm", "plot-lr")}
    assert "learning rate (log scale)" in svg["plot-lr"]  # 1e-6 .. 1e-1
    assert "(log scale)" not in svg["plot-loss"]  # 1.8 .. 2.3
    assert "(log scale)" not in svg["plot-grad-norm"]  # 0.8 .. 30: 1.6 decades


@pytest.mark.parametrize("history", [{}, {"steps": [], "loss": [], "grad_norm": [], "param_norm": [],
                                          "lr": [], "layers": [], "absmax": [], "event_step": None,
                                          "skipped": []}])
def test_empty_history_and_sparse_report(history: dict) -> None:
    for report in (make_report(), {}, make_report(origin=None, reproduced=False, cause="not_reproduced",
                                                  precursors=None, bisection=None, hint=None)):
        page = render_html(report, history)
        els = Elements(page)
        assert set(els.ids()) >= {"verdict", "heatmap", "plot-loss", "plot-grad-norm", "plot-lr",
                                  "origin", "precursors"}
        assert els.find("rect", "cell") == []
        for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
            assert len(els.find("path", "series", pid)) >= 1
    page = render_html(make_report(origin=None, reproduced=False, cause="not_reproduced"), {})
    assert "not reproduced" in section_text(page, "verdict")


# ---------------------------------------------------------------- headless Chromium

CHROMIUM_TIMEOUT = 90
# Chromium's own start-up requests, whatever the page: the network-time query and the on-device
# model manifest check are switched off by flags in run_chromium; Gaia's cookie-jar ListAccounts
# has no switch, so that one exact request line is told apart from the page's requests.
BROWSER_SERVICE_REQUESTS = ("CONNECT accounts.google.com:443 ",)
# Under load Chromium sometimes gets further into its start-up chores (component updates,
# optimization hints) before the page is done: those go to its own Google service hosts, which
# the report page never names (test_no_external_references checks the page has no URL at all).
BROWSER_SERVICE_HOSTS = (".google.com:", ".googleapis.com:", ".gvt1.com:")


def chromium_executable() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    pytest.fail("headless Chromium is required for these tests and was not found: "
                "install it with `apt-get install -y chromium chromium-driver` (.ci/run does)")


def run_chromium(url: str, *flags: str, profile: Path, timeout: float = CHROMIUM_TIMEOUT) -> str:
    """Run headless Chromium on ``url`` with ``flags``; return stdout. Kills the whole process
    group on timeout so no renderer outlives the test."""
    cmd = [chromium_executable(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--disable-features=NetworkTimeServiceQuerying",
           f"--optimization-guide-manifest-override={profile / 'no-model-manifest'}", *flags, url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium timed out after {timeout}s: {' '.join(cmd)}")
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {err[-2000:]}"
    return out


class RecordingProxy(socketserver.ThreadingTCPServer):
    """A stand-in HTTP proxy on 127.0.0.1 that records every connection and its first line,
    and answers 502 to everything."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.connections: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: RecordingProxy = self.server  # type: ignore[assignment]
        with server.lock:
            server.connections.append("")
            i = len(server.connections) - 1
        self.request.settimeout(5)
        try:
            line = self.request.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
            with server.lock:
                server.connections[i] = line
            self.request.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n"
                                 b"Connection: close\r\n\r\n")
        except OSError:
            pass


@contextmanager
def recording_proxy() -> Iterator[RecordingProxy]:
    proxy = RecordingProxy()
    thread = threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(5)


def connections_through_proxy(page: Path, profile: Path) -> list[str]:
    """First request line of every connection Chromium opened while loading ``page`` with all
    traffic, loopback included, sent to a recording proxy; Chromium's own start-up requests
    (``BROWSER_SERVICE_REQUESTS``) left out."""
    with recording_proxy() as proxy:
        port = proxy.server_address[1]
        run_chromium(page.as_uri(), "--dump-dom", f"--proxy-server=http://127.0.0.1:{port}",
                     "--proxy-bypass-list=<-loopback>", profile=profile)
        with proxy.lock:
            seen = list(proxy.connections)
    # (an empty line: a connection to the proxy that sent nothing, which Chromium opens ahead
    # of use now and then and closes unused; a request from the page has a request line)
    return [line for line in seen if line and not line.startswith(BROWSER_SERVICE_REQUESTS)
            and not (line.startswith("CONNECT ")
                     and any(h in line.split()[1] + " " for h in BROWSER_SERVICE_HOSTS))]


@pytest.fixture(scope="module")
def report_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    path.write_text(render_html(make_report(), make_history()), encoding="utf-8")
    return path


def test_chromium_dom(report_page: Path, tmp_path: Path) -> None:
    dom = run_chromium(report_page.as_uri(), "--dump-dom", profile=tmp_path / "profile")
    els = Elements(dom)
    assert "NaN first made by aten.log in encoder.2.act (call 0) at step 6 — cause: invalid." \
        in section_text(dom, "verdict")
    assert len(els.find("rect", "cell", "heatmap")) == len(LAYERS) * len(STEPS)
    for pid in ("plot-loss", "plot-grad-norm", "plot-lr"):
        paths = els.find("path", "series", pid)
        assert paths and all(p["d"].startswith("M") for p in paths), pid


def test_chromium_screenshot(report_page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    run_chromium(report_page.as_uri(), f"--screenshot={shot}", "--window-size=1200,1600",
                 "--hide-scrollbars", profile=tmp_path / "profile")
    assert shot.exists(), "chromium wrote no screenshot"
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000, f"screenshot is only {len(data)} bytes"


def test_chromium_makes_no_request(report_page: Path, tmp_path: Path) -> None:
    seen = connections_through_proxy(report_page, tmp_path / "profile")
    assert seen == [], f"the report page made requests: {seen}"


def test_proxy_control_sees_external_request(tmp_path: Path) -> None:
    """Positive control: the same setup does see a page's external request, so the check above
    is able to fail; and with the report's CSP the same image is not requested."""
    img = '<img src="http://example.invalid/x.png" alt="">'
    plain = tmp_path / "plain.html"
    plain.write_text(f"<!DOCTYPE html><html><body>{img}</body></html>", encoding="utf-8")
    seen = connections_through_proxy(plain, tmp_path / "p1")
    assert any("example.invalid/x.png" in line for line in seen), seen
    guarded = tmp_path / "guarded.html"
    guarded.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
                       f'content="{CSP}"></head><body>{img}</body></html>', encoding="utf-8")
    assert connections_through_proxy(guarded, tmp_path / "p2") == []


def test_proxy_is_local_only() -> None:
    with recording_proxy() as proxy:
        host, port = proxy.server_address[:2]
        assert host == "127.0.0.1"
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"GET http://example.invalid/ HTTP/1.1\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 502")
        with proxy.lock:
            assert proxy.connections == ["GET http://example.invalid/ HTTP/1.1"]


def test_the_root_module_is_named_as_in_the_text_report() -> None:
    """An origin in the root module's own forward (module ""): the verdict said "made by
    aten.log (call 0)" and the origin table's module cell was empty, where the text report
    says <root>."""
    report = make_report(event={"step": 6, "phase": "forward", "module": ""},
                         origin={**make_report()["origin"], "module": ""})
    page = render_html(report, make_history())
    assert "NaN first made by aten.log in <root> (call 0) at step 6" in section_text(page, "verdict")
    assert "module<root>" in section_text(page, "origin").replace(" ", "")
    report = make_report(event={"step": 6, "phase": "forward", "module": ""}, reproduced=False)
    assert "(forward, <root>) was not reproduced" in section_text(
        render_html(report, make_history()), "verdict")
