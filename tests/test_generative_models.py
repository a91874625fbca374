"""Generative models as their communities write them (``generative_models``), end to end: the
recorder on the training loop, then ``nanreplay --json`` on its bundle."""

from __future__ import annotations

import json
from pathlib import Path

import generative_models as G
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay.cli import main as cli

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where generative_models.py, the factory's module, lives


def test_a_codebook_written_through_data_is_bundled_as_the_step_found_it(tmp_path):
    """The EMA codebook update writes ``embed`` through ``.data``, which does not move its
    version counter: step 0's update leaves NaN in the dead codes, step 1's forward meets it.
    The bundle held the codebook as step 0 had found it (the copy was not taken again), so the
    replay said ``not_reproduced``; it now holds it as step 1 found it, and the replay names
    the codebook."""
    torch.manual_seed(0)
    model = G.make_tiny_vqvae()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.rand(64, 3, 8, 8) * 2 - 1
    found = {}
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=tmp_path, factory="generative_models:"
                            "make_tiny_vqvae"):
            for step in range(4):
                found[step] = {n: b.clone() for n, b in model.named_buffers()}
                x = data[torch.randint(0, 64, (8,))]
                opt.zero_grad()
                out, commit = model(x)
                (F.mse_loss(out, x) + 0.25 * commit).backward()
                opt.step()
    err = info.value
    assert err.event["step"] == 1 and err.event["module"] == "quantize", err.event
    _, t = read_bundle(err.bundle_path)
    for name, b in found[1].items():
        assert torch.equal(t[f"buffers/{name}"].isnan(), b.isnan()), name
        assert torch.equal(t[f"buffers/{name}"].nan_to_num(), b.nan_to_num()), name
    res = CliRunner().invoke(cli, [str(err.bundle_path), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["reproduced"] is True, json.dumps(rep, indent=1)
    assert rep["origin"]["param"] == "quantize.embed", rep["origin"]
