"""A layer added to the model after the recorder attached (a continual-learning task head,
given to the optimizer with ``add_param_group``): nothing hooks, checks or bundles it, so the
recorder says so once, and attaching again records it."""

from __future__ import annotations

import json
from pathlib import Path

import loop_models as LM
import pytest
import torch
from bundles import invoke_cli
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.target import UNKNOWN_WARNING

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir: Path, reattach: bool) -> NonFiniteError:
    """Task 2's head comes at step 5; at step 9 a NaN lands in its weight (an in-place edit)."""
    model = LM.make_multi_head()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="loop_models:make_multi_head",
                            factory_kwargs={"n_heads": 2}) as rec:
            for step in range(12):
                if step == 5:
                    model.heads.append(nn.Linear(32, 3))
                    opt.add_param_group({"params": model.heads[1].parameters()})
                    if reattach:
                        rec.detach()
                        rec.attach()
                if step == 9:
                    with torch.no_grad():
                        model.heads[1].weight[0, 0] = float("nan")
                x, y = torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return info.value


def test_a_head_added_after_attach_is_warned_about_once(out_dir, caplog):
    """The new head's NaN was blamed on the root module and its bundle could not be replayed
    ('the bundle holds no weights for parameter heads.1.weight ... the factory builds a
    different model'), with nothing said at the time the head came."""
    _train(out_dir, reattach=False)
    expected = UNKNOWN_WARNING.format(n=2)
    assert [r.getMessage() for r in caplog.records].count(expected) == 1, caplog.records


def test_attaching_again_records_the_added_head(out_dir, caplog):
    err = _train(out_dir, reattach=True)
    assert not any("did not have when the recorder attached" in r.getMessage()
                   for r in caplog.records)
    assert (err.event["step"], err.event["phase"], err.event["params"]) == \
        (9, "weights", ["heads.1.weight"])
    rep = json.loads(invoke_cli(err.bundle_path, "--json").stdout)
    assert (rep["reproduced"], rep["cause"], rep["origin"]["param"]) == \
        (True, "weights", "heads.1.weight")
