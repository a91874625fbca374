"""Normalizing flows and VAEs as their repositories train them (``flow_models``): RealNVP's
logit preprocessing and couplings, Glow's 1x1 convolution, a VAE's reparameterisation and KL,
IWAE's importance weights; the recorder on the loop, then ``nanreplay --json`` on its bundle."""

from __future__ import annotations

import json
from pathlib import Path

import flow_models as M
import pytest
import torch
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # where flow_models.py, the factory's module, lives


def binarized(step: int, n: int = 8) -> torch.Tensor:
    """A batch of binarized images (MNIST's dynamic binarisation of grey levels)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.bernoulli(torch.rand(n, M.D_X, generator=g), generator=g)


def train(out_dir: Path, factory: str, loss, batch, steps: int = 5, lr: float = 1e-3,
          call=lambda rec, out, x: rec.loss_fn(out, x), expect=NonFiniteError, **kw):
    """Train ``flow_models.<factory>(**kw)`` on ``batch(step)`` until the recorder (or the
    loop, ``expect``) raises; returns the error."""
    model = getattr(M, factory)(**kw)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with pytest.raises(expect) as info:
        with FlightRecorder(model, opt, loss_fn=loss, out_dir=out_dir, factory_kwargs=kw,
                            factory=f"flow_models:{factory}") as rec:
            for step in range(steps):
                x = batch(step)
                opt.zero_grad()
                call(rec, model(x), x).backward()
                opt.step()
    return info.value


def test_iwae_samples_stacked_before_the_batch_are_named(tmp_path):
    """IWAE draws K posterior samples per input, ``z`` of shape (K, B, D): the log-weights
    are (K, B). A record loaded without binarisation (grey levels 0..255 where 0/1 belong)
    drives the decoder's sigmoid to exactly 0 at a pixel that is not (log(p) = -inf).
    The event and the report named no sample: only a tensor with the batch in dim 0 (or a
    sequence-first module's dim 1) was read for samples; a value the forward made with the
    batch in dim 1 behind a leading (K) stack now names its samples."""
    K = 3

    def batch(step):
        x = binarized(step)
        if step == K:  # a record whose pixels were left as grey levels
            x[4] = torch.randint(0, 256, (M.D_X,), generator=torch.Generator().manual_seed(7))
        return x

    err = train(tmp_path, "make_iwae", M.iwae_loss, batch,
                call=lambda rec, out, x: rec.loss_fn(out))
    raw = [i for i, row in enumerate(batch(K)) if bool((row > 1).any())]
    assert raw == [4]
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (K, "forward", "", raw), ev
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("forward", "", "aten.log", raw, "underflow"), json.dumps(rep, indent=1)
    assert o["source"].startswith("flow_models.py:"), o["source"]
    assert "logsigmoid or BCEWithLogitsLoss on the logits" in rep["hint"], rep["hint"]

