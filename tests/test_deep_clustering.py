"""End to end: deep clustering (DEC/IDEC, DeepCluster-v2) and neural topic models (ProdLDA,
a Dirichlet VAE, ETM) written as their repositories write them (``deep_clustering_models``),
trained under the recorder until a planted bug fires, then replayed with the CLI."""

from __future__ import annotations

from pathlib import Path

import deep_clustering_models as M
import pytest
import torch
from bundles import nanreplay_json
from torch.utils.data import DataLoader, TensorDataset

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)  # deep_clustering_models.py is trusted here


def line_of(text: str) -> str:
    lines = Path(M.__file__).read_text().splitlines()
    return f"deep_clustering_models.py:{next(i for i, t in enumerate(lines, 1) if text in t)}"


def recorded(out_dir, factory: str, model, opt, loss_fn=None):
    return FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                          factory=f"deep_clustering_models:{factory}")


# --------------------------------------------------------------------------------------------
# DEC / IDEC


def train_idec(out_dir, factory: str, far: int | None = None):
    """IDEC-pytorch's loop: centres from k-means on the embeddings (batch by batch, as pt-dec's
    ``predict`` gathers them), the target distribution of the whole data set each step, then
    ``gamma * KL(p || q) + MSE``; ``far``: a record 40 units away from the others."""
    model = getattr(M, factory)()
    g = torch.Generator().manual_seed(0)
    X, _ = M.blobs(g, 32)
    if far is not None:
        X[far] += 40.0
    loader = DataLoader(TensorDataset(X, torch.arange(len(X))), batch_size=M.BATCH)
    with torch.no_grad():
        z = torch.cat([model.ae(x)[1] for x, _ in loader])
        model.assignment.cluster_centers.copy_(M.kmeans(z, M.CLUSTERS))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with recorded(out_dir, factory, model, opt, M.idec_loss) as rec:
        for _epoch in range(2):
            for x, idx in loader:
                with torch.no_grad():
                    p = M.target_distribution(model(X)[1])
                x_bar, q = model(x)
                loss = rec.loss_fn(x_bar, q, x, p[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return model


def test_kmeans_singleton_centre_at_a_sqrt_distance_is_exact_not_rounding(tmp_path):
    # a record far from the others is a k-means cluster of its own: its centre is its
    # embedding bit for bit, sqrt(sum((z - mu)**2)) is sqrt(0) and its derivative NaN
    with pytest.raises(NonFiniteError) as info:
        train_idec(tmp_path, "make_idec_euclidean", far=2)
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (0, "backward")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"]) == (
        True, "assignment", "SqrtBackward0", [2]), rep
    assert o["source"] == line_of("torch.sqrt(norm_squared)"), o["source"]
    # (was: precision, "rounding put the op's input on its pole": the float64 re-run widened
    # the stored centre but recomputed the embedding, so only it was off the pole)
    assert rep["cause"] == "invalid", rep
    hint = rep["hint"]
    assert "row 2 of assignment.cluster_centers equals an activation" in hint, hint
    assert "vector_norm" in hint and "rounding put" not in hint, hint


def test_healthy_idec_with_kmeans_centres_has_no_event(tmp_path):
    # the same loop and k-means without the far record, and the squared distance of pt-dec
    model = train_idec(tmp_path, "make_idec")
    assert not list(tmp_path.glob("*.nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
