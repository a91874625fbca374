"""Shared weights end to end: a language model whose output projection is tied to the token
embedding (by the class, by the training script after building it, or functionally as
``h @ emb.weight.T``), one block applied three times per forward, a siamese encoder. The
replay must compute what the run did: a factory that builds the layers apart where the run
tied them is tied again, one that ties what the run held apart is untied, each with a note.
Healthy runs raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import pytest
import tied_weights_models as M
import torch
import torch.nn.functional as F
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def tokens(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, M.VOCAB - 1, (4, 6), generator=g)  # (never the last token)


def lm_loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, M.VOCAB), idx.roll(-1, 1).reshape(-1))


def train(model, batch, loss, out_dir, factory, steps=4, record=True, between=None):
    """A plain loop; ``between(step, model)`` runs before each step's forward."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    rec = FlightRecorder(model, optimizer, out_dir=out_dir, factory=factory) if record \
        else contextlib.nullcontext()
    with rec:
        for step in range(steps):
            if between is not None:
                between(step, model)
            optimizer.zero_grad()
            value = loss(model, *batch(step))
            if record:
                rec.record_loss(value)
            value.backward()
            optimizer.step()
            losses.append(value.item())
    return losses


def fire(*args, **kw) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as e:
        train(*args, **kw)
    return e.value


def nan_row(owner: str, row: int, at: int):
    """The loop writes NaN into one row of ``owner``'s weight before step ``at``."""
    def between(step, model):
        if step == at:
            with torch.no_grad():
                model.get_submodule(owner).weight[row] = float("nan")
    return between


def test_factory_without_the_tie_the_script_made(tmp_path):
    """The script ties ``lm_head.weight = tok_emb.weight`` after the factory's ``Untied()``
    built the model, then writes NaN into the row of a token no batch holds: only the tied
    head reads it, so a replay that left the factory's layers apart would see no reader
    (before: it stopped, 'the bundle holds no weights for parameter lm_head.weight')."""
    model = M.Untied()
    model.lm_head.weight = model.tok_emb.weight
    row, at = M.VOCAB - 1, 2
    e = fire(model, lambda s: (tokens(s),), lm_loss, tmp_path, "tied_weights_models:Untied",
             between=nan_row("tok_emb", row, at))
    assert (e.event["step"], e.event["phase"]) == (at, "weights")
    report = nanreplay_json(e.bundle_path)
    origin = report["origin"]
    assert (origin["param"], origin["op"], origin["module"]) == (
        "tok_emb.weight", "aten.mm", "lm_head")
    assert origin["samples"] == list(range(len(tokens(at))))  # every row's logits read it
    assert report["cause"] == "weights"
    assert f"only row(s) {row} of {M.VOCAB}" in report["hint"]
    assert any("the run tied lm_head.weight to tok_emb.weight" in p
               for p in report["problems"])


def test_factory_tying_what_the_run_held_apart(tmp_path):
    """The run trained ``Untied``; the factory given builds ``Tied``. The NaN row is the
    head's own: loading the bundle into the tied layers (before: silently, the embedding's
    finite weights in the head) would leave no op reading it."""
    row, at = M.VOCAB - 1, 2
    e = fire(M.Untied(), lambda s: (tokens(s),), lm_loss, tmp_path, "tied_weights_models:Tied",
             between=nan_row("lm_head", row, at))
    assert (e.event["step"], e.event["phase"]) == (at, "weights")
    report = nanreplay_json(e.bundle_path)
    origin = report["origin"]
    assert (origin["param"], origin["op"], origin["module"]) == (
        "lm_head.weight", "aten.mm", "lm_head")
    assert report["cause"] == "weights"
    assert any("ties lm_head.weight to another parameter, which the run held apart" in p
               for p in report["problems"])


@pytest.mark.parametrize("written, row, reader, op", [
    ("lm_head", M.VOCAB - 1, "lm_head", "aten.mm"),  # a token no batch holds: the head alone
    ("lm_head", 1, "tok_emb", "aten.embedding"),  # one a batch looks up: the embedding first
])
def test_a_nan_written_into_a_tied_weight_is_named_as_its_reader_holds_it(tmp_path, written,
                                                                            row, reader, op):
    """``Tied`` (the class ties ``lm_head.weight = tok_emb.weight``); the loop writes NaN into
    row ``row`` of ``lm_head.weight`` before step ``at``. The bundle holds the tensor once,
    under its first name, and the report said only "parameter tok_emb.weight", read by
    lm_head: a name the loop never wrote and the reading module does not use. It now says
    the tensor is one with lm_head.weight, and, where the reader holds it as that alias, so."""
    at = 2
    e = fire(M.Tied(), lambda s: (tokens(s),), lm_loss, tmp_path, "tied_weights_models:Tied",
             between=nan_row(written, row, at))
    assert (e.event["step"], e.event["phase"]) == (at, "weights")
    first, alias = "tok_emb.weight", f"{written}.weight"
    # the recorder's own message names the tensor's other name too (it named the first only)
    assert f"Parameters: {first} (one tensor with {alias}: tied)." in str(e), str(e)
    report = nanreplay_json(e.bundle_path)
    o = report["origin"]
    reads = tokens(at) == row  # (the lookups of the bad row, else every row's logits)
    samples = sorted({int(i) for i in reads.nonzero()[:, 0]}) if reads.any() \
        else list(range(len(tokens(at))))
    assert (o["param"], o["aliases"], o["module"], o["op"], o["samples"]) == (
        first, [alias], reader, op, samples)
    assert o.get("read_as") == (alias if reader == written else None)
    assert report["cause"] == "weights" and report["reproduced"]
    text = invoke_cli(e.bundle_path).stdout
    assert f"parameter {first} (one tensor with {alias}: tied)" in text
    assert (f"in {reader}, call 0, as {alias}, first" in text) == (reader == written), text


def test_shared_block_overflows_in_its_third_application(tmp_path):
    """One ``x + exp(fc(x))`` block applied three times; an outlier record at step 2 makes
    it overflow in a later application: the report names that call of ``block``."""
    model = M.SharedBlock()
    with torch.no_grad():
        model.block.fc.weight.copy_(torch.eye(M.DIM) * 0.5)
        model.block.fc.bias.zero_()
    at, row = 2, 3

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, M.DIM, generator=g) * 0.1, torch.randint(0, 3, (6,), generator=g)
        if step == at:
            x[row] = 5.0
        return x, y

    e = fire(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), tmp_path,
             "tied_weights_models:SharedBlock")
    assert (e.event["step"], e.event["phase"]) == (at, "forward")
    h, call = batch(at)[0], None  # the first application whose exp overflows, by hand
    with torch.no_grad():
        for i in range(model.depth):
            if not torch.isfinite(torch.exp(model.block.fc(h))).all():
                call = i
                break
            h = model.block(h)
    assert call is not None and call > 0
    report = nanreplay_json(e.bundle_path)
    origin = report["origin"]
    assert (origin["op"], origin["module"], origin["call"]) == ("aten.exp", "block", call)
    assert origin["samples"] == [row]
    assert report["cause"] == "overflow"


@pytest.mark.parametrize("make", ["Tied", "FunctionalTied"])
def test_healthy_tied_models_train_identically(tmp_path, make):
    """The tied weight's gradient (the sum of both paths) raises nothing, no warning, and the
    recorder changes nothing the run computes."""
    args = (lambda s: (tokens(s),), lm_loss, tmp_path, f"tied_weights_models:{make}")
    torch.manual_seed(0)
    recorded = train(getattr(M, make)(), *args)
    torch.manual_seed(0)
    bare = train(getattr(M, make)(), *args, record=False)
    assert recorded == bare
    assert not list(tmp_path.glob("*.nan"))


def test_healthy_siamese_encoder_trains_identically(tmp_path):
    """One ``nn.Linear`` applied to both inputs of each pair."""
    def batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g), \
            torch.rand(5, generator=g)

    def loss(m, a, b, t):
        return F.mse_loss(m(a, b), t)

    torch.manual_seed(0)
    recorded = train(M.Siamese(), batch, loss, tmp_path, "tied_weights_models:Siamese")
    torch.manual_seed(0)
    bare = train(M.Siamese(), batch, loss, tmp_path, "tied_weights_models:Siamese",
                 record=False)
    assert recorded == bare
    assert not list(tmp_path.glob("*.nan"))
