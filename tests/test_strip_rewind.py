"""``nanreplay --strip`` of a bundle recorded with a rewind window: the window holds a copy of
the weights (and optimizer state) and every window step's batch, loss inputs and output
gradients. A "safe to share" copy must drop those with the event step's own."""

from __future__ import annotations

import json

import models as M
import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")

SECRET = 1234.5  # a value of every batch, which no stripped copy may hold


def rewind_bundle(out_dir):
    """Adam over the tests' MLP, a rewind window of 3 steps; the batch of step 4 holds NaN."""
    torch.manual_seed(0)
    model = M.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def make(step):
        x, y = M.batch(step)
        x[0, 0] = SECRET
        if step == 4:
            x[1, 1] = float("nan")
        return x, y

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            factory="models:mlp", rewind=3):
            M.train(model, opt, nn.CrossEntropyLoss(), 6, make_batch=make)
    return info.value.bundle_path


def holds_secret(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool((t == SECRET).any())


@pytest.mark.parametrize("parts", [("batch",), ("weights",), ("batch", "weights")])
def test_strip_drops_the_rewind_windows_copies_too(out_dir, parts):
    bundle = rewind_bundle(out_dir)
    meta, full = read_bundle(bundle)
    weights = {k for k in full if k.startswith("rewind/weights/") or k.startswith("rewind/optim")}
    batches = {k for k in full if k.startswith("rewind/step/") and "/rng/" not in k}
    assert weights and batches and any(holds_secret(full[k]) for k in batches)
    share = out_dir / "share.nan"
    args = [a for p in parts for a in ("--strip", p)]
    r = invoke_cli(bundle, *args, "-o", share)
    assert r.exit_code == 0, r.stdout
    meta2, t = read_bundle(share)
    left = set(t)
    # (was: every rewind/ tensor kept, the window's batches and its copy of the weights)
    assert left.isdisjoint(weights) == ("weights" in parts), sorted(left & weights)
    assert left.isdisjoint(batches) == ("batch" in parts), sorted(left & batches)
    assert not any(holds_secret(v) for v in t.values()) == ("batch" in parts)
    # the window's RNG states and ring stay: they hold no data of the run's
    assert any(k.startswith("rewind/step/") and "/rng/" in k for k in left)
    assert {k for k in full if k.startswith("ring/")} <= left
    records = meta2["rewind"]["records"]
    assert [r["step"] for r in records] == [r["step"] for r in meta["rewind"]["records"]]
    has_inputs = any("inputs" in mb for r in records for mb in r["micro_batches"])
    assert has_inputs == ("batch" not in parts)
    # the stripped copy still loads and reports (an input event from the event itself),
    # re-running no window it lacks the data of
    r = invoke_cli(share, "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code in (0, 1) and rep["window"] is None, r.stdout[-800:]
    assert (rep["cause"], rep["origin"]["samples"]) == ("input", [1]), rep
