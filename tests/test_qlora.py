"""QLoRA: a frozen int8 base weight held in a wrapper tensor subclass (``tests/qlora_models.py``),
LoRA adapters trained with AdamW. The bundle stores the subclass's inner tensors (it has no
storage of its own: the writer once read address 0 and hung), the replay rebuilds it as the
factory's own class and names the dequantizing op."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import qlora_models as M
import torch
from torch.nn import functional as F

from recorder import FlightRecorder, NonFiniteError

BAD_ROW = 3


def _train(model, out_dir, *, recorder=True, plant=None, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []

    def loop(loss_fn):
        for step in range(steps):
            x, y = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
            if plant is not None and step == plant:
                with torch.no_grad():  # (a corrupt absmax scale: row BAD_ROW dequantizes to NaN)
                    model.proj.weight.scale[BAD_ROW] = float("nan")
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())

    if not recorder:
        loop(F.mse_loss)
        return losses
    with FlightRecorder(model, opt, loss_fn=F.mse_loss, out_dir=out_dir,
                        factory="qlora_models:make_qlora") as rec:
        loop(rec.loss_fn)
    return losses


def test_healthy_qlora_is_bit_identical_with_the_recorder(tmp_path):
    for make in (M.make_qlora, M.make_qdora):
        torch.manual_seed(0)
        bare = _train(make(), tmp_path, recorder=False)
        torch.manual_seed(0)
        recorded = _train(make(), tmp_path)
        assert recorded == bare
    assert not list(tmp_path.glob("*.nan"))


_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import test_qlora as T, qlora_models as M
from recorder import NonFiniteError
torch.manual_seed(0)
try:
    T._train(M.make_qlora(), {out!r}, plant=1)
except NonFiniteError as e:
    print(json.dumps({{"step": e.event["step"], "bundle": str(e.bundle_path)}}))
"""


def test_nan_absmax_scale_is_bundled_and_replayed_to_the_dequantizing_mul(tmp_path):
    tests = str(Path(__file__).parent)
    # (a subprocess with a timeout: the writer once hung reading the wrapper's address 0)
    done = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests, out=str(tmp_path))],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(tests).parent)
    assert done.returncode == 0, done.stderr[-2000:]
    event = json.loads(done.stdout.strip().splitlines()[-1])
    assert event["step"] == 1  # (planted as step 1 began)
    from replay import replay

    rep = replay(event["bundle"], factory=M.make_qlora)
    o = rep["origin"]
    assert rep["event"]["step"] == event["step"]
    assert rep["cause"] == "weights" and rep["reproduced"]  # (bad before the step's forward)
    assert (o["module"], o["param"]) == ("proj", "proj.weight")
    # the re-run holds the factory's Int8Weight: the NaN is made where it dequantizes
    assert o["op"] == "aten.mul" and o["source"].endswith("qlora_models.py:39")
    assert o["samples"] == list(range(6))  # (every sample reads row BAD_ROW)
    assert o["rows"] == [BAD_ROW]
    # (the note names the subclass's inner tensor that holds the NaN, and its row)
    assert rep["problems"] == [
        "proj.weight is a qlora_models.Int8Weight tensor subclass whose inner tensor 'scale' "
        f"was non-finite (row(s) {BAD_ROW} of 8) as the step began: it dequantizes to "
        "non-finite values (the quantization that made it, an all-zero block's scale, or a "
        "write into it)"]


def test_bundle_writer_refuses_a_tensor_without_storage(tmp_path):
    from recorder.bundle import write_bundle

    w = M.Int8Weight.from_float(torch.ones(2, 2))
    try:
        write_bundle(tmp_path, "x", {}, {"weights/w": w})
    except TypeError as e:
        assert "Int8Weight" in str(e) and "__torch_dispatch__" in str(e)
    else:
        raise AssertionError("a wrapper tensor was written")
    assert not list(tmp_path.iterdir())


def test_wrapper_tensors_are_stored_inner_and_dense():
    from recorder.wrapped import store_wrapped

    w = M.Int8Weight.from_float(torch.randn(4, 3))
    meta, tensors = {}, {"weights/w": w}
    store_wrapped(meta, tensors)
    assert type(tensors["weights/w"]) is torch.Tensor
    assert torch.equal(tensors["weights/w"], w.dequantize())
    assert torch.equal(tensors["wrapped/weights/w/qdata"], w.qdata)
    assert meta["wrapped"]["weights/w"] == {"class": "qlora_models.Int8Weight",
                                            "inner": ["qdata", "scale"], "context": False}


@pytest.mark.parametrize("plant", [0, 1])
def test_nan_scale_of_a_frozen_quantized_weight_says_it_arrived_so_not_an_update(tmp_path, plant):
    """The int8 base weight is frozen and no optimizer holds it: nothing of the loop updates
    it. Its NaN scale was called the loop's own EMA update's ('t.mul_(m).add_(s)', a
    multiplicative update's 0/0); it is now said to have arrived so (a quantized checkpoint,
    the quantizer's absmax scale), at the first step seen (plant 0) or put there between
    steps (plant 1: a write into its inner tensor), with the quantizer's floor as the fix."""
    from replay import replay

    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        _train(M.make_qlora(), tmp_path, plant=plant)
    assert info.value.event["step"] == plant
    rep = replay(str(info.value.bundle_path), factory=M.make_qlora)
    o, hint = rep["origin"], rep["hint"]
    assert (rep["event"]["step"], rep["cause"], o["module"], o["op"], o["param"]) == \
        (plant, "weights", "proj", "aten.mul", "proj.weight"), json.dumps(rep, indent=1)
    assert o["samples"] == list(range(6)) and o["rows"] == [BAD_ROW]
    assert "quantized (qlora_models.Int8Weight" in hint and "'scale'" in hint, hint
    assert "absmax scale of an all-zero block" in hint and "clamp_min(eps)" in hint, hint
    assert "momentum/EMA target" not in hint and "loop's own update" not in hint, hint
    assert ("first step the recorder saw" if plant == 0 else "between steps") in hint, hint
