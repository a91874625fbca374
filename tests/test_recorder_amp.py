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


class _TwoHeads(nn.Module):
    """A trunk and two heads; the second, deeper one only runs while ``both`` is set (a branch
    a loop turns off: a warm-up head, a layer-drop schedule)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a = nn.Linear(M.D_IN, 64), nn.Linear(64, M.N_CLASSES)
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                               nn.Linear(64, M.N_CLASSES))
        self.both = True

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.a(h) + self.b(h) if self.both else self.a(h)


def test_gradients_a_skipped_step_left_behind_are_not_read_by_a_later_smaller_step(out_dir):
    """The skipped steps' overflowing gradient norms stay in that step's row; a later step
    that writes fewer gradient norms (a head that stopped running) must not find them."""
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # overflows: skipped
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler) as rec:
        for step in range(6):
            model.both = step < 3
            x, y = M.batch(step)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = crit(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            # from step 3 on, a scale that fits (and head b no longer runs)
            scaler.update(1.0 if step == 2 else None)
        assert [lay.skipped for lay in rec.cycle.ring.layouts] == [True] * 3 + [False] * 3
    assert rec.event is None and bundles(out_dir) == []


def test_a_disabled_grad_scaler_is_accepted_and_changes_nothing(out_dir):
    """nanoGPT's loop: GradScaler(enabled=(dtype == float16)) under bfloat16 is a disabled
    scaler, passed to the recorder like an enabled one. It was refused ('scaler must be a
    torch.amp.GradScaler, got GradScaler': a disabled scaler sets none of its state). It is
    recorded as no scaler: the losses are an unrecorded run's, and a NaN is an event."""

    def run(record: bool, bad_step=None):
        torch.manual_seed(0)
        model = M.mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        crit = nn.CrossEntropyLoss()
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler) \
            if record else None
        losses = []
        if rec:
            rec.attach()
        for step in range(5):
            x, y = M.batch(step)
            if step == bad_step:
                x[2, 0] = float("nan")
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        if rec:
            rec.detach()
        return losses

    assert run(True) == run(False)
    with pytest.raises(NonFiniteError) as info:
        run(True, bad_step=3)
    check_event(info.value.event, step=3, phase="input", samples=[2])


class _HalfHead(nn.Module):
    """A float32 layer, then a float16 head: the scaler refuses to unscale its gradients."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 1).half()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)).half()).float()


@pytest.mark.parametrize("nan_input", [False, True])
def test_the_scalers_own_error_is_no_gradient_event(out_dir, nan_input):
    """``scaler.step`` raises 'Attempting to unscale FP16 gradients' over gradients still
    scaled, the float16 head's overflowed: the loop's error goes on, and the overflow is the
    scaler's, no event (it wrote a backward NaN bundle); a NaN the batch brought is still one."""
    torch.manual_seed(0)
    model = _HalfHead()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = torch.randn(16, 8) * 1000, torch.randn(16, 1)
    if nan_input:
        x[3, 2] = float("nan")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as info:
        with FlightRecorder(model, opt, loss_fn=nn.MSELoss(), scaler=scaler,
                            out_dir=out_dir) as rec:
            loss = rec.loss_fn(model(x), y)
            scaler.scale(loss).backward()
            assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
            scaler.step(opt)
    written = list(bundles(out_dir))
    if not nan_input:
        assert not written and not getattr(info.value, "__notes__", None)
        return
    (path,) = written
    event = read_bundle(path, want=lambda name: False)[0]["event"]
    assert (event["step"], event["phase"], event["samples"]) == (0, "input", [3]), event


@pytest.mark.parametrize("width", [16, 256], ids=["small_params", "large_params"])
def test_gradient_norms_in_the_history_are_the_unscaled_ones(out_dir, width):
    """A model whose parameters are all small (more than 16 of them, each under 32768
    elements: their norms are batched when the step closes, after ``scaler.unscale_``) had
    its gradient norms divided by the loss scale a second time in the history (1.3e-5 for
    0.85 at scale 65536): no large parameter's norm was re-read before the update, so the
    step's norms were taken for the scaled ones backward wrote. They are the norms the
    loop's ``clip_grad_norm_`` measured, for large parameters as before."""
    torch.manual_seed(0)
    depth = 9 if width == 16 else 1  # (18 small parameters; a 256 x 16 and a 4 x 256 weight)
    layers = [m for _ in range(depth) for m in (nn.Linear(16, width), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    clipped = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, scaler=scaler, out_dir=out_dir):
            for step in range(4):
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                if step == 3:
                    x[2] = float("nan")
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = crit(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                clipped.append(float(nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
                scaler.step(opt)
                scaler.update()
    _, tensors = read_bundle(info.value.bundle_path)
    steps, norms = tensors["ring/steps"].tolist(), tensors["ring/grad_norm"].tolist()
    recorded = {int(s): n for s, n in zip(steps, norms) if s >= 0}
    for s in range(3):
        assert recorded[s] == pytest.approx(clipped[s], rel=1e-3), (s, recorded, clipped)
