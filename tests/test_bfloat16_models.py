"""A model cast to bfloat16 outright whose one-pass variance cancels below 0 for a sample far
from 0: a ``precision`` cause. ``--try auto`` proposed only dropping the sample; computing in
float32, whose 24 bits keep the variance's sign, is the remedy a bfloat16 user can take."""

from __future__ import annotations

import json

import bf16_models as B
import pytest
import torch
from bundles import invoke_cli

from recorder import FlightRecorder, NonFiniteError


def test_a_bfloat16_cancellation_gets_float32_from_auto(out_dir):
    torch.manual_seed(0)
    model = B.make_bf16_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="bf16_models:make_bf16_regressor"):
            for s in range(20):
                x = torch.randn(16, 12, generator=torch.Generator().manual_seed(s))
                if s == 6:
                    x[3] = x[3] * 0.5 + 14.0  # a sensor whose offset was not removed
                y = x[:, :3].sum(-1) * 0.1
                opt.zero_grad()
                crit(model(x.bfloat16()), y.bfloat16()).backward()
                opt.step()
    res = invoke_cli(info.value.bundle_path, "--json", "--try", "auto")
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.stdout)
    o = rep["origin"]
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == \
        ("norm_in", "aten.rsqrt", [3], "precision"), rep
    tries = {t["try"]: t for t in rep["what_if"]}
    assert set(tries) == {"drop=3", "dtype=float32"}, tries
    assert tries["dtype=float32"]["finite"] is True, tries
