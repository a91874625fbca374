"""The HTML page's what-if table says what the text report's ``what-if`` lines say, on real
bundles: how far a finite try was re-run, where a non-finite one went non-finite, why a try
was not re-run. (It said "finite", "non-finite" and "not re-run" alone.)"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

from bundles import invoke_cli
from test_rewind import rare_tokens

HERE = Path(__file__).parent


class WhatIfRows(HTMLParser):
    """The cells of the page's ``table.whatif``, row by row."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._in, self._cell = False, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._in = ("class", "whatif") in attrs
        elif self._in and tag == "tr":
            self.rows.append([])
        elif self._in and tag == "td":
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self._in = False
        elif self._in and tag == "td":
            self.rows[-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def text_and_page(bundle: Path, page: Path, *tries: str) -> tuple[list[list[str]], list[list[str]]]:
    res = invoke_cli(bundle, "--html", page, *[a for t in tries for a in ("--try", t)])
    assert res.exit_code in (0, 1), res.stderr
    text = [ln[len("  what-if    "):].split(None, 1) for ln in res.stdout.splitlines()
            if ln.startswith("  what-if")]
    parser = WhatIfRows()
    parser.feed(page.read_text())
    return text, [r for r in parser.rows if r]


def test_the_pages_tries_say_what_the_text_says_on_a_rewind_window(out_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(HERE)
    err = rare_tokens(out_dir)
    text, page = text_and_page(err.bundle_path, tmp_path / "r.html", "eps=1e-8", "lr=0.1x")
    assert text[0][0] == "eps=1e-8" and re.fullmatch(r"finite through step 1 \(loss [\d.]+\)",
                                                     text[0][1]), text
    assert text[1] == ["lr=0.1x", "nan at step 0 (update of emb.weight (aten.addcdiv_))"]
    assert page == text


def test_the_page_says_why_a_try_was_not_re_run(toy, tmp_path, monkeypatch):
    monkeypatch.chdir(HERE.parent / "examples")
    text, page = text_and_page(toy, tmp_path / "r.html", "drop=5", "lr=0.1x")
    assert text[0][0] == "drop=5" and re.fullmatch(r"finite through step 37 \(loss [\d.]+\)",
                                                   text[0][1]), text
    assert text[1][1].startswith("not re-run: lr changes the optimizer's updates")
    assert page == text


def test_a_finite_try_says_what_its_re_run_could_not_do():
    """A try re-run only in part (a rank's bundle missing beside this one) says so on its line,
    where it read as a plain 'finite through step 3'."""
    from replay.rewind_text import what_if_verdict

    note = ("the bundles of rank(s) [1] are not beside this one, so the re-run's updates use "
            "the gradients of the ranks found only")
    t = {"try": "lr=0.1x", "finite": True, "inconclusive": False, "event_step": None,
         "origin": None, "steps": [0, 3], "loss": 0.8125, "note": note}
    assert what_if_verdict(t) == f"finite through step 3 (loss 0.8125); {note}"
