"""``nn.Embedding(max_norm=...)``: torch renormalises the looked-up rows of the weight in place
at every forward (``embedding_renorm_``), so a re-run changes the weights the bundle holds. The
replay said the model's forward writes them "through .data (a refit in place, a grid update)",
which sends a user looking for code of theirs that is not there; it names the embedding and its
max_norm now (``replay.refit_in_forward``)."""

from __future__ import annotations

import embedding_max_norm_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay.refit_in_forward import written_note

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(model, out_dir=None, zero_count_at=None) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    losses = []
    for ids, counts, y in M.batches(5, zero_count_at):
        opt.zero_grad()
        loss = crit(model(ids, counts), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_log_of_a_zero_count_beside_a_max_norm_embedding(out_dir):
    """Record 6 of step 0 has count 0: log(0) = -inf in the root's forward (a pole: invalid),
    which the head turns into NaN; the looked-up rows renormalised in place by the embedding
    are no part of it."""
    model = M.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="embedding_max_norm_models:make_model"):
            for ids, counts, y in M.batches(5, zero_count_at=(0, 6)):
                opt.zero_grad()
                crit(model(ids, counts), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (0, "forward")
    rep = nanreplay_json(info.value.bundle_path, code=0)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "", "aten.log", [6], "invalid"), (o, rep["cause"])


def test_the_re_run_s_note_names_the_embedding_s_renormalisation():
    """Whether a re-run moves the renormalised rows again is rounding's call (a row's norm
    scaled to max_norm lands an ulp above it, or not, by CPU kernel), so the note's text is
    checked where it is made."""
    model = M.make_model()
    note = written_note({"emb.weight": model.emb.weight.detach().clone()}, model)
    assert "nn.Embedding 'emb' (max_norm=1.0) renormalises the rows it looks up" in note, note
    assert ".data" not in note, note
    assert "through .data" in written_note({"head.weight": model.head.weight}, model)


def test_a_healthy_max_norm_run_trains_as_without_the_recorder(out_dir):
    plain = _train(M.make_model())
    model = M.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    losses = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for ids, counts, y in M.batches(5):
            opt.zero_grad()
            loss = crit(model(ids, counts), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses == plain and rec.event is None
