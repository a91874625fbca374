"""End to end on neural decoding (``neural_decoding_models``): an LFADS-style sequential VAE
of binned spike counts from two sessions of different neuron counts stitched by per-session
read-in and read-out layers (Poisson NLL at log rates over padded trials' real bins,
coordinated dropout, a KL to a learned prior, gradient clipping); a CEBRA-style encoder of
calcium imaging (dF/F over a rolling percentile baseline, or a z-score) trained with InfoNCE
over time-offset positives; a Poisson GLM with a spike-history filter from a DataLoader. Each
planted failure of the domain fires under the recorder and is replayed with the CLI; the
healthy versions raise no event and train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib

import neural_decoding_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def line_of(text: str) -> str:
    return source_line("neural_decoding_models.py", text)


def origin_of(rep: dict) -> tuple:
    o = rep["origin"]
    return rep["reproduced"], o["phase"], o["module"], o["op"], o["made"], o["samples"]


def train_lfads(crit, out_dir, make: str = "make_lfads", steps: int = 3, short: tuple = (),
                silent: tuple = (), eps: float = 1e-8, dropout: bool = False,
                record: bool = True):
    """Adam with gradient clipping, sessions alternating by batch, as LFADS trains;
    ``short``: trials of the last batch that end half-way (padded, masked); ``silent``:
    neurons of session 1 that never fire; ``dropout``: coordinated dropout."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_decoding_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            session = step % 2
            counts, mask = M.spike_batch(g, session, short=short if step == steps - 1 else (),
                                         silent=silent if session == 1 else ())
            x, held = M.coordinated_dropout(g, counts) if dropout else (counts, None)
            opt.zero_grad()
            extra = (held,) if dropout else ()
            loss_fn(model(x, mask, session), counts, mask, *extra).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 200.0)
            opt.step()
    return model


def train_cebra(crit, out_dir, make: str = "make_calcium", steps: int = 3, dead: tuple = (),
                offset: dict | None = None, record: bool = True):
    """Adam on InfoNCE at reference bin 5; the data conditions in the last batch."""
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"neural_decoding_models:{make}") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else crit
        for step in range(steps):
            last = step == steps - 1
            f = M.calcium_batch(g, dead=dead if last else (), offset=offset if last else None)
            opt.zero_grad()
            loss_fn(model(f), 5).backward()
            opt.step()
    return model


def train_glm(out_dir, steps: int = 3, wrapped: tuple = (), record: bool = True):
    """SGD on the Poisson NLL from a DataLoader; ``wrapped``: bins of the last batch."""
    model = M.make_glm()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    parts = [M.glm_batch(g, wrapped=wrapped if s == steps - 1 else ()) for s in range(steps)]
    data = TensorDataset(*[torch.cat([p[i] for p in parts]) for i in range(3)])
    rec = FlightRecorder(model, opt, loss_fn=M.glm_nll, out_dir=out_dir,
                         factory="neural_decoding_models:make_glm") if record else None
    with rec if rec is not None else contextlib.nullcontext():
        loss_fn = rec.loss_fn if rec is not None else M.glm_nll
        for stim, past, counts in DataLoader(data, batch_size=32):
            opt.zero_grad()
            loss_fn(model(stim, past), counts).backward()
            opt.step()
    return model


def fire(train, *args, **kwargs):
    with pytest.raises(NonFiniteError) as info:
        train(*args, **kwargs)
    return info.value.event, info.value.bundle_path


def test_hand_written_infonce_at_a_small_temperature_names_the_exp_and_cross_entropy(tmp_path):
    """InfoNCE written ``-log(e.diagonal() / e.sum(1))`` of ``e = exp(sim / 0.01)``: a cosine
    similarity near 1 is 100 over the temperature and exp overflows float32 at once; inf/inf
    is NaN. The replay names the exp, an overflow in every trial, and the softmax by hand it
    was part of (divided on the next line): cross_entropy / log_softmax, not float64."""
    ev, bundle = fire(train_cebra, M.InfoNCE(temperature=0.01, stable=False), tmp_path)
    assert (ev["step"], ev["phase"]) == (0, "loss"), ev
    rep = nanreplay_json(bundle)
    assert origin_of(rep) == (True, "loss", "<loss>", "aten.exp", "+inf", list(range(6)))
    assert rep["origin"]["source"] == line_of("e = torch.exp(sim)"), rep["origin"]
    assert rep["cause"] == "overflow", rep
    h = rep["hint"]
    assert line_of("return -torch.log(e.diagonal() / e.sum(1))") in h, h
    assert "a softmax written by hand" in h and "F.cross_entropy(s, target)" in h, h
