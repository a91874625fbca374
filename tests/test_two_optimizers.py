"""End to end: a sparse embedding trained by its own optimizer beside the recorded one.

``nn.EmbeddingBag(sparse=True)`` gives sparse gradients, which the bundle stores dense and the
replay checks; the recorder is given the dense tower's ``Adam``, so ``SparseAdam`` updates the
embedding outside it. Stepped before the recorded optimizer, it changes the embedding before
the bundle is written: the bundle says so and the replay does not blame the factory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sparse_models as SM
import torch
from bundles import invoke_cli, nanreplay_json

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from recorder.finite import bad_rows

K = 2  # the first step with a zero rating


pytestmark = pytest.mark.usefixtures("in_tests_dir")


def train(out_dir: Path, *, sparse_first: bool) -> NonFiniteError:
    """Train until user 4's rating is a missing one stored as 0 at step K: the loop's
    log-space loss is then +inf and the gradients on that row infinite, the embedding's too,
    which SparseAdam turns into NaN weights when it steps first."""
    model = SM.make_recommender()
    sparse = torch.optim.SparseAdam(list(model.items.parameters()), lr=0.01)
    dense = torch.optim.Adam(model.tower.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, dense, out_dir=out_dir,
                            factory="sparse_models:make_recommender"):
            for step in range(5):
                bags, offsets, rating = SM.batch(step)
                if step == K:
                    rating[4] = 0  # BUG: a missing rating stored as 0, whose log is -inf
                sparse.zero_grad()
                dense.zero_grad()
                loss = SM.log_loss(model(bags, offsets), rating)
                loss.backward()
                (sparse.step(), dense.step()) if sparse_first else (dense.step(), sparse.step())
    return info.value


def test_recorded_optimizer_stepped_first(tmp_path):
    """The sparse gradient is checked (its values) and the bundle is written, that gradient
    stored dense, non-finite in exactly the rows of user 4's items; the replay re-runs the
    step as recorded: the infinity entered from the loop's loss, on row 4."""
    err = train(tmp_path, sparse_first=False)
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    assert set(err.event["params"]) == {"items.weight", "tower.0.weight", "tower.0.bias",
                                        "tower.2.weight", "tower.2.bias"}
    meta, tensors = read_bundle(err.bundle_path)
    grad = tensors["grads/items.weight"]
    assert grad.layout == torch.strided and grad.shape == (SM.ITEMS, SM.DIM)
    user4 = set(SM.batch(K)[0][4 * SM.BAG: 5 * SM.BAG].tolist())
    assert set(bad_rows(grad)) == user4
    assert "changed_in_step" not in meta
    rep = nanreplay_json(err.bundle_path, code=0)
    assert (rep["origin"]["phase"], rep["origin"]["samples"], rep["reproduced"]) == (
        "loss", [4], True)
    assert rep["fidelity"]["matches"] is True
    assert not any("changed during the step" in p for p in rep["problems"])


def test_another_optimizer_stepped_first_is_named_not_the_weights(tmp_path):
    """SparseAdam's step() ran before the recorded Adam's and turned the infinite embedding
    gradient into NaN rows: the bundle holds those NaN weights, which the step's forward never
    saw. The recorder's event is the backward one (not weights already bad at step start), the
    bundle names the parameter that changed, and the replay neither blames the weights nor the
    factory: it reports what the recorder saw and says what to change."""
    err = train(tmp_path, sparse_first=True)
    assert (err.event["step"], err.event["phase"]) == (K, "backward")
    assert "items.weight" in err.event["params"]
    meta, tensors = read_bundle(err.bundle_path)
    assert meta["changed_in_step"] == ["items.weight"]
    assert not bool(torch.isfinite(tensors["weights/items.weight"]).all())
    rep = nanreplay_json(err.bundle_path, code=1)
    assert (rep["origin"]["phase"], rep["reproduced"], rep["cause"]) == ("backward", False, None)
    assert rep["hint"].startswith("the step cannot be re-run as it ran, since the bundle holds "
                                  "weights written after its forward")
    [note] = [p for p in rep["problems"] if "changed during the step" in p]
    assert note.startswith("parameter items.weight, which the recorded optimizer does not "
                           "hold, changed during the step before its step() ran"), note
    text = invoke_cli(err.bundle_path).stdout.splitlines()
    assert text[:2] == ["nanreplay: step 2, backward event — not re-run (weights written after "
                        "its forward)",
                        "  origin     backward: nan in the gradient of tower.0.weight (+4 more)"]
    # (the recorded Adam's gradients first: SparseAdam's items.weight is not its update's)
    assert err.event["params"][-1] == "items.weight"
