"""End to end: low-precision training written by hand (``low_precision_models``: FP8 linear
layers with delayed scaling from an amax history, a fairseq-style dynamic loss scaler, Adam with
block-wise float8 states, bfloat16 weights updated from float32 masters with Kahan compensation
and stochastic rounding), trained under the recorder until a planted bug fires, then replayed
with the CLI; and the healthy versions of the same loops, which must raise no event."""

from __future__ import annotations

import low_precision_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")

MODELS = "low_precision_models.py"


def batch(g, n: int = 8):
    x = torch.randn(n, M.D_IN, generator=g)
    return x, x[:, :M.N_CLASSES].argmax(1)


def token_batch(g, n: int = 8):
    """Token ids from the first half of the vocabulary only: the rest never get a gradient."""
    ids = torch.randint(1, M.VOCAB // 2, (n, M.SEQ), generator=g)
    mask = (torch.rand(n, M.SEQ, generator=g) > 0.2).float()
    return ids, mask, ids[:, 0] % M.N_CLASSES


def train_fp8(out_dir, factory: str, steps: int = 6, bad: tuple[int, int] | None = None):
    """AdamW with a warmup schedule; the forward takes a per-sample mask beside the input.
    ``bad``: (step, sample) whose record holds a NaN feature."""
    model = getattr(M, factory)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=out_dir,
                        factory=f"low_precision_models:{factory}") as rec:
        for _ in range(steps):
            x, y = batch(g)
            if bad is not None and rec.step == bad[0]:
                x[bad[1], 3] = float("nan")
            loss = rec.loss_fn(model(x, torch.ones(len(x))), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def train_scaled(out_dir, steps: int, max_scale=None):
    """SGD with momentum under a hand-written dynamic loss scaler: the step is skipped (its
    gradients dropped, rec.end_step() first, as the guide says) when a gradient overflowed."""
    model = M.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = M.DynamicLossScaler(max_scale=max_scale)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=out_dir,
                        factory="low_precision_models:make_mlp") as rec:
        for _ in range(steps):
            x, y = batch(g)
            loss = rec.loss_fn(model(x), y)
            opt.zero_grad()
            (loss * scaler.loss_scale).backward()
            grads = [p.grad for p in model.parameters()]
            overflow = not all(bool(torch.isfinite(gr).all()) for gr in grads)
            if overflow:
                rec.end_step()
                opt.zero_grad()
            else:
                for gr in grads:
                    gr.div_(scaler.loss_scale)
                opt.step()
            scaler.update(overflow)
    return scaler


def train_fp8_adam(out_dir, clip: float, steps: int = 4, keep=None, nan_at=None):
    """``keep``: how the update stays replayable (guard_optimizer=True, or rewind=N);
    ``nan_at``: the step whose mask holds a NaN."""
    model = M.make_token_classifier()
    opt = M.AdamFp8State(model.parameters(), lr=1e-3, clip=clip)
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, opt, loss_fn=F.cross_entropy, out_dir=out_dir,
                        **(keep or {"guard_optimizer": True}),
                        factory="low_precision_models:make_token_classifier_fp8_adam") as rec:
        for s in range(steps):
            ids, mask, y = token_batch(g)
            if s == nan_at:
                mask[2, 1] = float("nan")
            loss = rec.loss_fn(model(ids, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def event_of(fn, *args, **kwargs) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fn(*args, **kwargs)
    return info.value


def test_zero_initialised_fp8_layer_asks_to_guard_the_scale_not_to_start_the_history_nonzero(
        out_dir):
    # the residual branch's output projection starts at zero: its weight's amax is 0, the
    # delayed-scaling history stays 0, and fp8_max / 0 is inf (then 0 * inf: NaN)
    err = event_of(train_fp8, out_dir, "make_zero_init")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (0, "forward", "proj")
    # (was: the replay failed, "aminmax_cpu not implemented for Float8_e4m3fn")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "invalid", "proj", "aten.reciprocal", "+inf", list(range(8))), rep
    assert o["source"] == source_line(MODELS, "scale = fmax / amax"), o["source"]
    # (was: "a state vector started at zeros (a power iteration's u) ... start it nonzero",
    # which names the amax history, not the zero-initialised weight it only summarises)
    assert "parameter proj.weight" in rep["hint"] and "amax.clamp(min=eps)" in rep["hint"], \
        rep["hint"]
    assert "start it nonzero" not in rep["hint"], rep["hint"]


def test_a_module_returning_float8_codes_keeps_the_recorder_on(out_dir):
    # the casts are modules of their own whose outputs are float8 codes; a corrupt record at
    # step 3 must still be caught (was: "recorder disabled after an internal error
    # (aminmax_cpu not implemented for 'Float8_e4m3fn')" at step 0, training unrecorded)
    err = event_of(train_fp8, out_dir, "make_cast_modules", bad=(3, 2))
    ev = err.event
    assert (ev["step"], ev["phase"], ev["tensor"], ev["samples"]) == (3, "input", "args[0]", [2])
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["tensor"], o["samples"]) == (
        True, "input", "args[0]", [2]), rep
    assert "data pipeline" in rep["hint"], rep["hint"]


def test_unsaturated_e5m2_cast_with_a_stale_delayed_scale_asks_to_saturate(out_dir):
    # a value beyond the amax history's largest, times the delayed scale, is past e5m2's
    # 57344: without the clamp before the cast it becomes inf
    err = event_of(train_fp8, out_dir, "make_e5m2_unsaturated")
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (2, "forward", "inp")
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["op"], o["made"], o["samples"]) == (
        True, "overflow", "inp", "aten._to_copy", "+inf", [5]), rep
    assert o["source"] == source_line(MODELS, "q = y.to(dtype)"), o["source"]
    assert "float8_e5m2" in rep["hint"] and "saturate before it" in rep["hint"], rep["hint"]
    assert "amax history" in rep["hint"], rep["hint"]
    # (was: "compute this op in float32 (outside autocast, or .float() before it)": the cast
    # to float8 is the recipe's own)
    assert "compute this op in float32" not in rep["hint"], rep["hint"]


def test_an_uncapped_hand_written_loss_scale_that_reached_inf_is_named(out_dir):
    # in a float32 run nothing overflows to halve it: doubled every step from 2**15, the scale
    # passes float32's largest value at step 113 and (loss * inf).backward() is inf/NaN
    err = event_of(train_scaled, out_dir, steps=120)
    assert (err.event["step"], err.event["phase"]) == (113, "backward"), err.event
    rep = nanreplay_json(err.bundle_path)
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["module"], o["samples"]) == (
        True, "overflow", "<loss>", list(range(8))), rep
    # (was: cause none, "compute the whole loss inside loss_fn": the loss was fine)
    assert "infinite factor" in rep["hint"] and "Cap the scale" in rep["hint"], rep["hint"]
    assert "compute the whole loss inside loss_fn" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("keep", [{"guard_optimizer": True}, {"rewind": 2}])
def test_fp8_adam_state_of_a_zero_block_is_named_with_its_absmax(out_dir, keep):
    # half the embedding rows never get a gradient: their moment blocks are 0, quantised as
    # 0 / absmax 0 (NaN codes) at step 0, dequantised into the update at step 1
    err = event_of(train_fp8_adam, out_dir, clip=0.0, keep=keep)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == (
        1, "optimizer", ["embed.weight"]), err.event
    # (was: KeyError 'm' from the optimizer's own step: its tuple state was not in the bundle)
    rep = nanreplay_json(err.bundle_path)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["params"]) == (
        True, "optimizer", ["embed.weight"]), rep
    # (was: "loaded that way (optimizer.load_state_dict from a bad checkpoint)")
    assert "whose scale is 0" in rep["hint"] and "absmax.clip(1e-12)" in rep["hint"], rep["hint"]
    assert "load_state_dict" not in rep["hint"], rep["hint"]


def test_a_rewind_window_restores_tuple_optimizer_state(out_dir):
    # the moments are (float8 codes, block scales) tuples from step 0 on; the window's copy
    # at step 3 holds them (was: left out of the bundle, and the replay failed, KeyError 'm')
    err = event_of(train_fp8_adam, out_dir, clip=1e-12, steps=8, keep={"rewind": 3},
                   nan_at=6)
    assert (err.event["step"], err.event["phase"], err.event["samples"]) == (6, "input", [2])
    _, t = read_bundle(err.bundle_path)
    assert t["rewind/optim_seq/embed.weight/m/0"].dtype == torch.float8_e4m3fn
    rep = nanreplay_json(err.bundle_path)
    w = rep["window"]
    assert (rep["cause"], w["copy_step"], w["reproduced"], w["event_step"]) == (
        "input", 3, True, 6), rep
    # the factory builds the optimizer without the loop's clip: training's is set back (was:
    # the re-run's zero blocks made NaN moments at step 3, an update event at step 4)
    assert any("clip: 0.0 -> 1e-12" in p for p in rep["problems"]), rep["problems"]


def test_healthy_low_precision_loops_raise_no_event(out_dir):
    train_fp8(out_dir / "fp8", "make_zero_init_fixed")  # amax clamped: zero-init trains
    train_fp8(out_dir / "mlp", "make_mlp")
    train_fp8_adam(out_dir / "adam", clip=1e-12)
    scaler = train_scaled(out_dir / "scaler", steps=40, max_scale=2.0 ** 24)
    assert scaler.loss_scale == 2.0 ** 24
    model = M.make_bf16_mlp()
    masters = [p.detach().float() for p in model.parameters()]
    comps = [torch.zeros_like(w) for w in masters]
    g = torch.Generator().manual_seed(0)
    with FlightRecorder(model, None, loss_fn=F.cross_entropy, out_dir=out_dir / "kahan",
                        factory="low_precision_models:make_bf16_mlp") as rec:
        for _ in range(6):
            x, y = batch(g)
            loss = rec.loss_fn(model(x.bfloat16()).float(), y)
            loss.backward()
            rec.end_step()
            M.kahan_step(list(model.parameters()), masters, comps, lr=1e-2, generator=g)
    assert not list(out_dir.rglob("*.nan"))
