"""What-ifs on a loop whose ``clip_grad_norm_`` zeroed the gradients: AdamW at a rate far too
high, two decayed groups and a head under a LambdaLR warm-up, bf16 autocast with a CPU
GradScaler, accumulation of 3. Once the gradients' norm overflows float32, torch's clip
multiplies them by ``max_norm / inf = 0``; the window saw every update's norm as 0, learned
no max_norm, and the tries ran with the raw gradients: ``lr[2]=0.5x`` said +inf at step 13
where training with that change overflows at step 15."""

from __future__ import annotations

import math

import pytest
import torch
from test_rewind import nanreplay, what_if
from torch import nn

from recorder import FlightRecorder, NonFiniteError

ACCUMULATE, STEPS = 3, 40


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))


def train(out_dir=None, head_factor_from: int | None = None, head_factor: float = 1.0,
          until: int = 20):
    """The run (recorded when ``out_dir`` is given); from step ``head_factor_from`` on, the
    head group's rate times ``head_factor``. The first step whose loss is not finite, or
    None; recorded, the event."""
    torch.manual_seed(0)
    model = make_net()
    params = list(model.named_parameters())
    groups = [{"params": [p for n, p in params if p.ndim > 1 and not n.startswith("6.")],
               "lr": 100.0, "weight_decay": 0.05},
              {"params": [p for n, p in params if p.ndim == 1 and not n.startswith("6.")],
               "lr": 100.0, "weight_decay": 0.0},
              {"params": [p for n, p in params if n.startswith("6.")], "lr": 100.0,
               "weight_decay": 0.01}]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    scaler = torch.amp.GradScaler("cpu")
    crit = nn.MSELoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, scaler=scaler, lr_scheduler=sched,
                         rewind=6, out_dir=out_dir) if out_dir is not None else None
    with rec if rec is not None else torch.enable_grad():
        for step in range(until):
            opt.zero_grad(set_to_none=True)
            for k in range(ACCUMULATE):
                g = torch.Generator().manual_seed(1000 * step + k)
                x = torch.randn(6, 8, generator=g)
                y = 2 * x[:, :1] + 0.1 * torch.randn(6, 1, generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                loss = crit(out.float(), y) / ACCUMULATE
                if not math.isfinite(loss.item()):
                    return step
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            f = head_factor if head_factor_from is not None and step >= head_factor_from else 1
            opt.param_groups[2]["lr"] *= f
            scaler.step(opt)
            scaler.update()
            opt.param_groups[2]["lr"] /= f
            sched.step()
    return None


def test_a_try_zeroes_the_gradients_the_loops_clip_zeroed(out_dir):
    with pytest.raises(NonFiniteError) as info:
        train(out_dir)
    ev = info.value.event
    assert (ev["phase"], ev["module"]) == ("loss", "<loss>")
    rep = nanreplay(info.value.bundle_path, "lr[2]=0.5x")
    w = rep["window"]
    assert w["reproduced"] and w["event_step"] == ev["step"]
    # the plant: every recorded update's gradient norm in the window was 0 (clipped from
    # an overflowed norm), so no max_norm was learned, and the zeroing is re-applied
    assert w["loop_clip"] is None and w["loop_zeroes"]
    # the try's verdict is what training with that change does, from the window's copy on
    trained = train(head_factor_from=w["copy_step"], head_factor=0.5)
    tried = what_if(rep)["lr[2]=0.5x"]
    assert not tried["finite"] and tried["event_step"] == trained
