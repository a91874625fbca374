"""A GradScaler's scaled gradients of a large but finite loss: the backward hook's squared
norm of a scaled gradient (65536 times the true one) passes float32's range while every
gradient is finite, and the loop's ``unscale_`` / ``clip_grad_norm_`` make the recorder
measure them again before the update. The stale +inf stayed in the row: before, the
recorder stopped a finite run with "non-finite statistic with no identifiable source"."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError

SCALE = 2.0 ** 16  # GradScaler's default init_scale
INPUT_SCALE = 1e7
F32_MAX = torch.finfo(torch.float32).max


def run(out_dir, recorded: bool, clip: float | None, target_scale: float, steps: int = 4):
    """Unnormalised regression inputs (1e7) and targets under bf16 autocast and a CPU
    GradScaler, AdamW (whose update ignores the gradients' scale); accumulation of 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    crit = nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, scaler=scaler, out_dir=out_dir) \
        if recorded else None
    losses = []
    with rec or contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            for k in range(3):
                g = torch.Generator().manual_seed(10 * step + k)
                x = INPUT_SCALE * torch.randn(5, 4, generator=g)
                y = target_scale * (1 + torch.rand(5, 1, generator=g))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                loss = crit(out.float(), y) / 3
                losses.append(loss.item())
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
    return losses


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_scaled_gradients_norm_overflow_is_no_event(out_dir, clip):
    target_scale = 1e10
    # the plant: the first layer's scaled gradient (output gradient ~ target_scale / 15,
    # times the inputs) has a squared norm past float32's range, the unscaled one not; the
    # output's own scaled gradient stays within it
    first = target_scale / 15 * INPUT_SCALE
    assert (SCALE * first) ** 2 > F32_MAX > first ** 2
    assert (SCALE * 2 * target_scale / 15) ** 2 * 5 < F32_MAX
    plain = run(out_dir, False, clip, target_scale)
    assert all(math.isfinite(v) for v in plain)
    recorded = run(out_dir, True, clip, target_scale)  # (no NonFiniteError)
    assert recorded == plain
    assert not out_dir.exists() or not list(out_dir.glob("*.nan"))


def test_a_real_overflow_under_the_scaler_is_still_an_event(out_dir):
    # targets beyond float32's square root: the loss itself is +inf
    with pytest.raises(NonFiniteError) as info:
        run(out_dir, True, 1.0, 1e20, steps=2)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"]) == (0, "loss", "<loss>")
