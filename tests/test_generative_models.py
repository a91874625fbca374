"""Generative models as their communities write them (``generative_models``), end to end: the
recorder on the training loop, then ``nanreplay --json`` on its bundle."""

from __future__ import annotations

import json
from pathlib import Path

import generative_models as G
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train_vqvae(out_dir: Path, steps: int = 4, at=None, rewind: int | None = None, **quantize):
    """Train ``generative_models.make_tiny_vqvae(**quantize)`` until the recorder raises;
    ``at(step, model)`` runs before each step. Returns the error and each step's buffers as the
    step found them."""
    torch.manual_seed(0)
    model = G.make_tiny_vqvae(**quantize)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.rand(64, 3, 8, 8) * 2 - 1
    found = {}
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir, factory_kwargs=quantize, rewind=rewind,
                            factory="generative_models:make_tiny_vqvae"):
            for step in range(steps):
                if at is not None:
                    at(step, model)
                found[step] = {n: b.clone() for n, b in model.named_buffers()}
                x = data[torch.randint(0, 64, (8,))]
                opt.zero_grad()
                out, commit = model(x)
                (F.mse_loss(out, x) + 0.25 * commit).backward()
                opt.step()
    return info.value, found


def test_a_codebook_written_through_data_is_bundled_as_the_step_found_it(tmp_path):
    """The EMA codebook update writes ``embed`` through ``.data``, which does not move its
    version counter: step 0's update leaves NaN in the dead codes, step 1's forward meets it.
    The bundle held the codebook as step 0 had found it (the copy was not taken again), so the
    replay said ``not_reproduced``; it now holds it as step 1 found it."""
    err, found = train_vqvae(tmp_path)
    assert err.event["step"] == 1 and err.event["module"] == "quantize", err.event
    _, t = read_bundle(err.bundle_path)
    for name, b in found[1].items():
        assert torch.equal(t[f"buffers/{name}"].isnan(), b.isnan()), name
        assert torch.equal(t[f"buffers/{name}"].nan_to_num(), b.nan_to_num()), name
    assert nanreplay_json(err.bundle_path)["reproduced"] is True


@pytest.mark.parametrize("avg_from_embed, made", [(False, "nan"), (True, "+inf")])
def test_a_codebook_the_forward_made_non_finite_is_blamed_on_the_op_not_on_a_checkpoint(
        tmp_path, avg_from_embed, made):
    """Step 0's EMA update divides by a dead code's zero cluster size (0/0, or x/0 when
    ``embed_avg`` starts from the codebook); step 1's forward reads the codebook. The report
    said 'weights' (written outside optimizer.step(): a checkpoint, an edit) for the NaN, and
    for the +inf named the division as if this step's had started it. The forward writes that
    buffer itself and the re-run writes a non-finite value made from finite ones into it
    again: the origin is that division, the cause ``invalid``, and a note says the buffer
    carried it in from an earlier step."""
    err, _ = train_vqvae(tmp_path, avg_from_embed=avg_from_embed)
    assert err.event["step"] == 1, err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"], rep["cause"]) == \
        ("forward", "quantize", "aten.div", made, "invalid"), json.dumps(rep, indent=1)
    assert o["source"].startswith("generative_models.py:"), o["source"]
    assert rep["reproduced"] is True
    [note] = [p for p in rep["problems"] if p.startswith("buffer quantize.embed held")]
    assert "own forward writes it (aten.copy_ at generative_models.py:" in note, note
    assert note.endswith("in an earlier step; record with rewind=N to re-run the earlier "
                         "steps"), note


def test_the_codebook_note_does_not_ask_for_the_rewind_window_a_bundle_has(tmp_path):
    err, _ = train_vqvae(tmp_path, rewind=2)
    rep = nanreplay_json(err.bundle_path)
    [note] = [p for p in rep["problems"] if p.startswith("buffer quantize.embed held")]
    assert note.endswith("in an earlier step") and rep["window"] is not None, note


def test_a_codebook_made_non_finite_outside_the_forward_is_still_weights(tmp_path):
    """The same VQ-VAE with Laplace smoothing, whose forward writes finite codebooks: a NaN
    put into the codebook between steps (a bad checkpoint) is ``weights``, not the forward's."""

    def corrupt(step, model):
        if step == 2:
            model.quantize.embed[0, 3] = float("nan")

    err, _ = train_vqvae(tmp_path, at=corrupt, smooth=True)
    assert err.event["step"] == 2, err.event
    rep = nanreplay_json(err.bundle_path)
    assert (rep["origin"]["phase"], rep["origin"]["param"], rep["cause"]) == \
        ("weights", "quantize.embed", "weights"), json.dumps(rep, indent=1)
    assert not any(p.startswith("buffer ") for p in rep["problems"]), rep["problems"]
