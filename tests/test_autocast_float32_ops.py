"""An op a model computes in float32 inside a bfloat16 autocast region (LLaMA's RMSNorm casts
to float32 first) whose gradient overflows float32: the hint named the autocast type, 'compute
this op in float32 (outside autocast, or .float() before it)', which it already was."""

from __future__ import annotations

import pytest
import replay_models as R
import torch
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def test_a_float32_rmsnorm_under_bf16_autocast_is_named_in_float32(out_dir):
    """Token 7's embedding has shrunk to 1e-16: the eps-less RMSNorm's mean square is 1e-32,
    its rsqrt 1e16 (finite), the derivative -v^-1.5 / 2 is 5e47, past float32, finite in
    float64."""
    torch.manual_seed(0)
    model = R.make_rms_norm_lm()
    with torch.no_grad():
        model.emb.weight[7] = 1e-16
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir,
                            factory="replay_models:make_rms_norm_lm"):
            for step in range(6):
                ids = torch.randint(8, 40, (4, 10), generator=g)
                if step == 3:
                    ids[2, 5] = 7
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(ids[:, :-1])
                loss = nn.functional.cross_entropy(out.float().flatten(0, 1),
                                                   ids[:, 1:].flatten())
                loss.backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "backward")
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] and rep["cause"] == "overflow", rep["hint"]
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"]) == ("norm", "RsqrtBackward0", [2]), o
    assert "compute this op in float32" not in rep["hint"], rep["hint"]
    assert rep["hint"].endswith("or compute it in float64"), rep["hint"]
    # the origin says the gradient went bad in float32, and --try auto proposes float64 for it
    # (it proposed float32 from the autocast alone, which the op already computed in)
    assert o["dtype"] == "float32", o
    tried = [t["try"] for t in replay(info.value.bundle_path, tries=["auto"])["what_if"]]
    assert "dtype=float64" in tried and "dtype=float32" not in tried, tried
