"""A model that refuses float64 in one of its kernels (a fused kernel for half types and
float32 only). The float64 re-run that tells the causes apart raised, and the whole replay
failed ('replay failed (RuntimeError: fused_gelu: only float16, ...)'), the origin it had
already found lost with it. Now the report keeps the origin; the op computed alone in float64
still tells an overflow, and otherwise the cause is left open with the reason."""

from __future__ import annotations

import json

import kernel_models as K
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError

BAD_STEP, BAD_ROW = 4, 5


def _run(out_dir, crit, bad: float) -> NonFiniteError:
    """Regression through the fused-kernel net; at step 4 sample 5's target is ``bad``."""
    torch.manual_seed(0)
    model = K.make_fused_net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="kernel_models:make_fused_net"):
            for step in range(10):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(16, 8, generator=g), torch.rand(16, generator=g) + 0.5
                if step == BAD_STEP:
                    y[BAD_ROW] = bad
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def _report(bundle) -> dict:
    res = invoke_cli(bundle, "--json")
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def test_an_overflow_past_a_float32_only_kernel_is_told_by_the_op_alone(out_dir):
    """log-cosh of a residual of 200: cosh(200) is 3.6e86, beyond float32 and within float64,
    which the op computed alone in float64 says without the step's float64 re-run."""
    err = _run(out_dir, K.LogCoshLoss(), bad=200.0)
    rep = _report(err.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["op"], o["samples"], rep["cause"]) == \
        ("loss", "aten.cosh", [BAD_ROW], "overflow"), rep
    assert "float64 holds it" in rep["hint"], rep["hint"]


def test_a_nan_past_a_float32_only_kernel_keeps_its_origin_and_says_why_no_cause(out_dir):
    """The log of a target of -1 (a missing value's sentinel): only the step's float64 re-run
    could tell invalid from precision, and the model refuses float64 there."""
    err = _run(out_dir, K.LogTargetLoss(), bad=-1.0)
    rep = _report(err.bundle_path)
    o = rep["origin"]
    assert rep["reproduced"] and (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("loss", "<loss>", "aten.log", [BAD_ROW]), o
    assert rep["cause"] is None, rep["cause"]
    assert rep["hint"].startswith("the model raised in the float64 re-run that tells invalid "
                                  "from overflow, underflow and precision (RuntimeError: "
                                  "fused_gelu: only float16, bfloat16 and float32"), rep["hint"]
