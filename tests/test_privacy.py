"""Differential privacy as it is written by hand, the Opacus way: Poisson-sampled batches,
per-sample gradients (module hooks keeping ``grad_sample``), per-sample clipping and Gaussian
noise from a ``torch.Generator``; trained under the recorder until it raises, then replayed."""

from __future__ import annotations

from pathlib import Path

import privacy_models as PM
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)


def _data(n: int = 256, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.randint(0, 2, (n,), generator=g)


def test_an_empty_poisson_batch_is_recorded_and_its_empty_mean_named(out_dir, caplog):
    """Poisson sampling (each record joins the batch with probability q, as Opacus's
    UniformWithReplacementSampler draws) gives a batch of 0 records; CrossEntropyLoss's mean
    over it is 0/0. The recorder's min/max of the empty activations raised ('aminmax(): cannot
    compute aminmax over an empty dimension'), disabled it, and the NaN loss trained on
    unchecked; then the replay's instrumented pass left the empty outputs out and said the
    factory built another model ('did not run in the re-run')."""
    model = PM.make_classifier()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()
    X, Y = _data()
    g = torch.Generator().manual_seed(2)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="privacy_models:make_classifier") as rec:
            for step in range(8):
                keep = torch.rand(len(X), generator=g) < 0.02
                if step == 5:
                    keep[:] = False  # the draw that selects no record (q = 0.02, 256 records)
                opt.zero_grad()
                crit(model(X[keep]), Y[keep]).backward()
                opt.step()
    assert "internal error" not in caplog.text and rec.health.internal_errors == 0
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["kind"], ev["samples"]) == (5, "loss", "nan", [])
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("<loss>", "aten.nll_loss_forward")
    assert rep.get("fidelity", {}).get("matches", True), rep["fidelity"]
    assert "a mean over no element is 0/0" in rep["hint"] and "skip such batches" in rep["hint"]
