"""Mixed precision on CPU: steps a GradScaler skips are not events, but they count as steps.

float16 autocast with a huge initial scale makes the scaled gradients overflow, so the scaler
skips ``optimizer.step()`` and halves the scale until they fit.
"""

from __future__ import annotations

import models as M
import pytest
import torch
from models import bundles, check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle


def amp_train(model, opt, scaler, steps, *, rec=None, make_batch=M.batch):
    """The AMP loop; returns, per step, whether the scaler skipped it (its scale went down)
    and ``rec.step`` after it."""
    crit = nn.CrossEntropyLoss()
    skipped, rec_steps = [], []
    for step in range(steps):
        x, y = make_batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = crit(model(x), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if rec is not None:
            rec_steps.append(rec.step)
    return skipped, rec_steps


def test_skipped_steps_are_not_events_and_count(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    n = 8
    with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                        scaler=scaler) as rec:
        skipped, rec_steps = amp_train(model, opt, scaler, n, rec=rec)
        assert rec.step == n
    assert any(skipped) and not all(skipped), skipped  # both kinds of steps happened
    assert rec_steps == list(range(1, n + 1))  # a skipped step counts like any other
    assert rec.event is None and bundles(out_dir) == []
    assert rec.step == n


@pytest.mark.parametrize("n", [1, 5])
def test_every_step_skipped_including_the_last(out_dir, n):
    """The last step is skipped too: it is closed at detach, and still is no event."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                        scaler=scaler) as rec:
        skipped, rec_steps = amp_train(model, opt, scaler, n, rec=rec)
        assert rec.step == n
    assert all(skipped)
    assert rec_steps == list(range(1, n + 1))
    assert rec.event is None and bundles(out_dir) == []


def test_ring_records_skips_and_scales(out_dir):
    """A NaN input after some skipped steps: the bundle's ring marks which steps were skipped
    and the scale at each."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    k = 6

    def make(step):
        x, y = M.batch(step)
        if step == k:
            x[2, 2] = float("nan")
        return x, y

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            scaler=scaler):
            skipped, _ = amp_train(model, opt, scaler, k + 1, make_batch=make)
    check_event(info.value.event, step=k, phase="input", tensor="batch", samples=[2])
    meta, t = read_bundle(info.value.bundle_path)
    assert t["ring/steps"].tolist() == list(range(k + 1))
    # the skip pattern of the same run without the recorder (which changes nothing)
    pattern = _skip_pattern(k)
    assert any(pattern) and not all(pattern)
    assert t["ring/skipped"][:k].tolist() == pattern
    assert torch.isfinite(t["ring/scale"]).all()
    assert meta["grad_scaler"]["class"].endswith("GradScaler")
    assert meta["micro_batches"][0]["autocast"] == {"cpu": "float16"}


def _skip_pattern(n):
    torch.manual_seed(0)
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)
    skipped, _ = amp_train(model, opt, scaler, n)
    return skipped


def test_scale_collapse_is_an_event(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            scaler=scaler, min_scale=2.0 ** 38):
            amp_train(model, opt, scaler, 6)
    ev = info.value.event
    check_event(ev, reason="scale_collapse", phase="backward", kind="scale")
    assert ev["step"] == 2  # scales 2**39, 2**38, 2**37 < min_scale after step 2


def test_too_many_skips_in_a_row_is_an_event(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            scaler=scaler, max_skipped_steps=3):
            amp_train(model, opt, scaler, 6)
    check_event(info.value.event, step=3, reason="scale_skipping", phase="backward",
                kind="scale")


def test_bf16_autocast_trains_without_event(out_dir):
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for step in range(4):
            x, y = M.batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            loss.backward()
            opt.step()
    assert rec.event is None and rec.step == 4
