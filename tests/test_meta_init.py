"""Models built the way torchtitan and LLM fine-tuning scripts build them
(``meta_init_models``): on the meta device, then ``to_empty`` and the model's ``init_weights``,
which computes the non-persistent RoPE table and causal mask; or under
``torch.set_default_dtype(torch.bfloat16)``. Before: the replay's second build of such a
factory, which tells how the model starts, crashed on the meta tensors ``to_empty`` copies
(``Tensor.item() cannot be called on meta tensors``), so a RoPE table of ``theta = 0`` got the
generic 'checkpoint loading, in-place edits' hint; without a factory, the class's default
theta builds it finite and the hint said the loop wrote it; a mask ``init_weights`` never
filled was blamed on 'where it is made' rather than ``to_empty``; and a bfloat16 variance of
1e-42, which float32 keeps as a subnormal, was said to round to 0 in float32 too, so
``--try auto`` never tried float32."""

from __future__ import annotations

import contextlib

import meta_init_models as M
import pytest
import torch
import torch.nn.functional as F
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

B, STEPS, K, ROW, TINY = 4, 3, 2, 3, 1e-21


def _run(make, out_dir, record, factory, batch):
    """``STEPS`` steps of AdamW on ``batch(step, g)``; the losses, or the event's error."""
    torch.manual_seed(0)
    model = getattr(M, make)()
    loss_fn = M.lm_loss if make != "make_bf16_regressor" else F.mse_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rec = FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir,
                         factory=f"meta_init_models:{make}" if factory else None) \
        if record else None
    losses = []
    try:
        with rec if rec is not None else contextlib.nullcontext():
            lf = rec.loss_fn if rec is not None else loss_fn
            for step in range(STEPS):
                x, y = batch(step, g)
                loss = lf(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
    except NonFiniteError as e:
        return e
    return losses


def _tokens(step, g):
    t = torch.randint(0, M.VOCAB, (B, M.SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _readings(bad: bool):
    """Sensor rows in bfloat16; at step K, row ROW in another unit (``TINY`` times)."""
    def batch(step, g):
        x = torch.randn(B + 1, 6, generator=g).bfloat16()
        if bad and step == K:
            x[ROW] *= TINY
        return x, torch.randn(B + 1, 1, generator=g).bfloat16()
    return batch


def _lm(make, out_dir, factory=True):
    err = _run(make, out_dir, True, factory, _tokens)
    assert isinstance(err, NonFiniteError) and err.event["step"] == 0, err
    return err.bundle_path


@pytest.mark.parametrize("make, batch", [("make_model", _tokens),
                                         ("make_bf16_regressor", _readings(False))])
def test_healthy_meta_and_bf16_builds_train_bit_identically(tmp_path, make, batch):
    recorded = _run(make, tmp_path, True, True, batch)
    assert recorded == _run(make, tmp_path, False, True, batch)
    assert all(map(torch.isfinite, map(torch.tensor, recorded)))
    assert not list(tmp_path.glob("*.nan"))


def _weights_origin(rep, param, op_text):
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["param"], o["tensor"], rep["cause"]) == (
        0, "weights", param, "buffer", "weights"), rep
    assert (o["source"], o["samples"]) == (source_line("meta_init_models.py", op_text),
                                           list(range(B))), rep


def test_rope_theta_0_is_named_by_the_division_that_made_the_table(tmp_path):
    rep = nanreplay_json(_lm("make_bad_rope", tmp_path))
    _weights_origin(rep, "freqs_cis", "xc * freqs_cis")
    at = source_line("meta_init_models.py", "freqs = 1.0 / (theta **")
    assert f"aten.reciprocal of 0 made +inf at {at}, which later ops turned into NaN" \
        in rep["hint"], rep["hint"]


def test_rope_theta_0_without_factory_does_not_blame_the_loop(tmp_path):
    """The model keeps its ``rope_theta`` (``self.rope_theta``): rebuilt with the run's 0
    (``replay.config_args``), not the default, the table's division is named as with a factory."""
    rep = nanreplay_json(_lm("make_bad_rope", tmp_path, factory=False))
    _weights_origin(rep, "freqs_cis", "xc * freqs_cis")
    assert "the factory builds buffer freqs_cis finite" not in rep["hint"]
    at = source_line("meta_init_models.py", "freqs = 1.0 / (theta **")
    assert f"aten.reciprocal of 0 made +inf at {at}, which later ops turned into NaN" \
        in rep["hint"], rep["hint"]
    assert any("constructor arguments the model kept as data" in p for p in rep["problems"])


def test_mask_left_by_to_empty_names_to_empty_and_init_weights(tmp_path, deterministic):
    bundle = _lm("make_unfilled_mask", tmp_path)
    rep = nanreplay_json(bundle)
    _weights_origin(rep, "mask", "att = att + mask")
    at = source_line("meta_init_models.py", 'model.to_empty(device="cpu")')
    assert f"Module.to_empty at {at} allocated it" in rep["hint"], rep["hint"]
    assert "init_weights" in rep["hint"]
    # a factory filling the mask (-inf above the diagonal) does not build the bundle's NaN
    other = nanreplay_json(bundle, "--factory", "meta_init_models:make_model")
    _weights_origin(other, "mask", "att = att + mask")
    assert "the factory builds" not in other["hint"], other["hint"]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)  # (fills to_empty's memory with NaN)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_bf16_variance_underflow_float32_keeps_is_sent_to_float32(tmp_path):
    err = _run("make_bf16_regressor", tmp_path, True, True, _readings(True))
    assert isinstance(err, NonFiniteError) and err.event["step"] == K, err
    rep = nanreplay_json(err.bundle_path, "--try", "dtype=float32")
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], o["dtype"], rep["cause"]) == (
        "norm", "aten.rsqrt", [ROW], "bfloat16", "underflow"), rep
    assert o["source"] == source_line("meta_init_models.py", "torch.rsqrt(var + self.eps)")
    assert "as float32 would too" not in rep["hint"] and "float32 holds it" in rep["hint"]
    assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("dtype=float32", True)]
