"""Hand-written optimizers from popular repos (torch.optim.Optimizer subclasses, handed to the
replay by the factory), trained under the recorder until their update goes non-finite."""

from __future__ import annotations

from pathlib import Path

import pytest
import zf_models as ZF
from bundles import nanreplay_json
from custom_optimizers_models import SophiaG
from torch import nn

from recorder import FlightRecorder, NonFiniteError

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _from_tests_dir(monkeypatch):
    monkeypatch.chdir(HERE)


def _train_sophia(out_dir, **kw) -> NonFiniteError:
    """Sophia-G's loop: the Gauss-Newton hessian estimate refreshed every k=10 steps."""
    model = ZF.make_model()
    opt = SophiaG(ZF.param_groups(model), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    step = 0
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="custom_optimizers_models:make_sophia", **kw):
            for x, y in ZF.loader(dead=5):
                opt.zero_grad()
                crit(model(x), y).backward()
                if step % 10 == 0:
                    opt.update_hessian()
                opt.step()
                step += 1
    return info.value


@pytest.mark.parametrize("kw", [{}, {"guard_optimizer": True}], ids=["after-update", "guard"])
def test_sophia_with_eps_0_gets_its_own_hint_not_adams_formula(out_dir, kw):
    """SophiaG with eps=0 and a feature 0 in every record: the column of embed.weight that
    reads it has m = h = 0, so m.abs() / (rho * h + eps) is 0/0 at the first update. The hint
    was Adam's ('m = v = 0, so m / (sqrt(v) + eps) ... the default 1e-8'), a formula and a
    default this optimizer does not have."""
    err = _train_sophia(out_dir, **kw)
    rep = nanreplay_json(err.bundle_path, "--try", "eps=1e-8", code=None)
    assert rep["event"]["step"] == 0 and rep["cause"] == "optimizer", rep
    assert rep["origin"]["param"] == "embed.weight", rep["origin"]
    hint = rep["hint"]
    assert "SophiaG's update at step 0 made" in hint, hint
    assert "sqrt(v)" not in hint and "m = v = 0" not in hint, hint
    assert "second-moment or curvature estimate + eps), 0/0: set eps > 0" in hint, hint
    if kw:
        assert rep["reproduced"] and rep["origin"]["op"] == "aten.div", rep["origin"]
        assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("eps=1e-8", True)]
