"""The three renderings of one replay agree: ``nanreplay --json``, the text report and the
``--html`` page (rendered by headless Chromium), over real bundles of recently added report
content: an optimizer's failed decomposition (a ``linalg`` event, an origin told by a sentence,
not an op), a loss swapped mid-run (an origin with no op, a note) and a validation batch run
with gradients on (a micro-batch, samples, a note). The step, cause, op, samples and every note
the JSON holds are in the text and on the page, with the same values; the page's verdict says
what the text's origin line says (it said an op *made* a non-finite value where a finite
matrix was refused, and named a parameter where the gradient entered from the loss)."""

from __future__ import annotations

import contextlib
import json
import re
from html import unescape
from pathlib import Path

import changed_mid_run_models as M
import optimizer_linalg_models as OL
import pytest
import torch
from bundles import invoke_cli
from test_eval_loops import run as run_eval_loop
from test_html_report import run_chromium, section_text
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.cause_text import module_label

pytestmark = pytest.mark.usefixtures("in_tests_dir")

DEAD = 2  # the Shampoo's dead input column (a 0 row and column of its preconditioner)
SWAP_AT, SWAP_K, SWAP_ROW = 3, 6, 5  # the loss swapped at, the step and row planted
VAL_AT, VAL_I, VAL_ROW = 3, 1, 2  # after training step 3, validation batch 1's row 2 empty


def _linalg(out):
    model = OL.make_model()
    opt, crit = OL.CholeskyShampoo(model.parameters()), nn.CrossEntropyLoss()
    with pytest.raises(torch.linalg.LinAlgError), FlightRecorder(
            model, opt, loss_fn=crit, out_dir=out, guard_optimizer=True,
            factory="optimizer_linalg_models:make_shampoo"):
        for x, y in OL.batches(dead=DEAD):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    return next(out.glob("*.nan")), {"step": OL.START, "op": "aten.linalg_cholesky_ex",
                                     "cause": "invalid", "samples": None}


def _swapped_loss(out):
    model = M.make_net()
    opt, crit = torch.optim.AdamW(model.parameters(), lr=0.01), nn.CrossEntropyLoss()
    sched, loss_fn = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), crit
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=crit, out_dir=out, factory="changed_mid_run_models:make_net"):
        for step, (x, y) in enumerate(M.batches(8)):
            if step == SWAP_AT:
                loss_fn = M.NaiveFocal()  # (the recorder was given the other one)
            if step == SWAP_K:
                x = x.clone()
                x[SWAP_ROW] *= 1e4
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            sched.step()
    return info.value.bundle_path, {"step": SWAP_K, "op": None, "cause": None,
                                    "samples": [SWAP_ROW]}


def _eval_with_grad(out):
    with pytest.raises(NonFiniteError) as info:
        run_eval_loop(True, out, grad_off=contextlib.nullcontext,
                      val_empty=(VAL_AT, VAL_I, VAL_ROW))
    return info.value.bundle_path, {"step": VAL_AT + 1, "op": "aten.div", "cause": "invalid",
                                    "samples": [VAL_ROW]}


PLANTS = {"linalg": _linalg, "swapped_loss": _swapped_loss, "eval_with_grad": _eval_with_grad}


@pytest.fixture(scope="module")
def renderings(tmp_path_factory):
    """Per plant: the expected values, the JSON report, the text report and the page as
    Chromium's DOM; the bundles are built once for the module, from tests/ (as in_tests_dir)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(Path(__file__).parent)
        for name, plant in PLANTS.items():
            out[name] = _rendered(tmp_path_factory.mktemp(name), plant)
    return out


def _rendered(d, plant):
    torch.manual_seed(0)
    bundle, expected = plant(d)
    rep = json.loads(invoke_cli(bundle, "--json").stdout)
    page = d / "report.html"
    text = invoke_cli(bundle, "--html", page).stdout
    dom = run_chromium(page.as_uri(), "--dump-dom", profile=d / "profile")
    return expected, rep, text, dom


@pytest.mark.parametrize("name", list(PLANTS))
def test_json_text_and_page_agree(renderings, name):
    expected, rep, text, dom = renderings[name]
    o, step = rep["origin"], rep["event"]["step"]
    assert (step, o.get("op"), rep.get("cause")) == \
        (expected["step"], expected["op"], expected["cause"]), rep
    if expected["samples"] is not None:
        assert o["samples"] == expected["samples"], o
    page = unescape(re.sub(r"<[^>]+>", "", dom))
    verdict = section_text(dom, "verdict")
    assert text.startswith(f"nanreplay: step {step},") and f"step {step}" in verdict
    cause = rep.get("cause")
    assert f"  cause      {cause or 'unknown'} — " in text
    assert (f"cause: {cause}." in verdict) if cause else "cause:" not in verdict
    assert rep["hint"] in text and rep["hint"] in verdict
    origin_line = next(line for line in text.splitlines() if line.startswith("  origin"))
    if o.get("detail"):  # the origin is a sentence: the page's verdict says the same
        assert o["detail"] in origin_line and o["detail"].rstrip(".") in verdict
        assert "made by" not in verdict, verdict
    else:
        assert f"made by {o['op']} in {module_label(o['module'])}" in origin_line
        assert f"made by {o['op']} in {module_label(o['module'])}" in verdict
    if o.get("samples") and not o.get("all_samples"):
        assert f"  samples    {o['samples']}" in text
        assert ", ".join(map(str, o["samples"])) in section_text(dom, "origin")
    for note in rep["problems"]:
        assert f"  note       {note}" in text and note in page, note
