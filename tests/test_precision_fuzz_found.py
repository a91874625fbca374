"""Found by a fuzz run of record -> bundle -> ``nanreplay --json`` over precision settings
(float32, autocast bfloat16 and float16 with a GradScaler, models cast to bfloat16 or float16
with and without a float32 master copy, float64), each with torch's own modules and a planted
cause: the training loops as users write them, and what the recorder or the replay said."""

from __future__ import annotations

import precision_fuzz_found_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def batch(g, n: int = 8, t: int = 4):
    x = torch.randn(n, t, 8, generator=g)
    pad = torch.zeros(n, t, dtype=torch.bool)
    pad[:, -1] = torch.rand(n, generator=g) > 0.5
    return x, pad, torch.randint(0, 4, (n,), generator=g)


def test_a_float32_master_copy_of_a_bfloat16_model_is_told_to_record_without_the_optimizer(
        tmp_path):
    """bfloat16 weights updated through float32 master copies the optimizer holds (copied
    back after each step): the optimizer holds none of the model's parameters. Before, the
    refusal said to build the optimizer from the model's parameters() (training in bfloat16,
    the thing the master copy avoids); the guide's way is no optimizer."""
    model = M.make_bf16_classifier()
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-3)
    with pytest.raises(ValueError) as excinfo:
        FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=tmp_path,
                       factory="precision_fuzz_found_models:make_bf16_classifier")
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert "float32 copies of its bfloat16 parameters" in msg, msg
    assert "FlightRecorder(model, None, ...)" in msg, msg
    assert "build the optimizer from this model's parameters()" not in msg, msg


def test_a_loss_event_under_a_grad_scaler_skip_is_not_said_to_mismatch_gradients_it_lacks(
        tmp_path):
    """float16 autocast with a GradScaler; the loop's masked mean (a lambda, which the replay
    cannot rebuild) divides by an empty mask at step 2. The scaler skips that update and the
    next iteration's zero_grad() clears the gradients before the forward that closes the step,
    so the bundle holds none. Before, the report said that feeding the recorded output gradient
    through the model's backward 'did not give the recorded non-finite parameter gradients
    back', comparing with gradients it did not hold."""
    model = M.AttnClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)

    def masked_mean(out, y, keep):  # (a local function: the replay cannot import it)
        return (F.cross_entropy(out.float(), y, reduction="none") * keep).sum() / keep.sum()

    with pytest.raises(NonFiniteError), FlightRecorder(
            model, opt, loss_fn=masked_mean, out_dir=tmp_path, scaler=scaler,
            factory="precision_fuzz_found_models:AttnClassifier") as rec:
        for step in range(5):
            x, pad, y = batch(g)
            keep = torch.zeros(len(x)) if step == 2 else torch.ones(len(x))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = rec.loss_fn(model(x, pad), y, keep)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rep = nanreplay_json(next(tmp_path.glob("*.nan")), code=None)
    assert (rep["event"]["step"], rep["event"]["phase"]) == (2, "loss"), rep["event"]
    assert rep["origin"]["samples"] == list(range(8)), rep["origin"]
    notes = " | ".join(rep["problems"])
    assert "did not give the recorded non-finite parameter gradients back" not in notes, notes
    assert "the bundle holds no gradients" in notes, notes
