"""Hand-written optimizers from popular repos (torch.optim.Optimizer subclasses, handed to the
replay by the factory), trained under the recorder until their update goes non-finite."""

from __future__ import annotations

import pytest
import zf_models as ZF
from bundles import nanreplay_json
from custom_optimizers_models import HFAdafactor, Shampoo, SophiaG
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, make_opt, factory: str, dead: int | None = None, **kw) -> NonFiniteError:
    """Train ``ZF.make_model()`` with ``make_opt(param_groups)`` under the recorder until it
    raises (``dead``: the feature that is 0 in every record); an optimizer with a Hessian
    estimate (Sophia-G's Gauss-Newton one) has it refreshed every k=10 steps."""
    model = ZF.make_model()
    opt = make_opt(ZF.param_groups(model))
    crit = nn.CrossEntropyLoss()
    hessian = getattr(opt, "update_hessian", None)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"custom_optimizers_models:{factory}", **kw):
            for step, (x, y) in enumerate(ZF.loader(dead=dead)):
                opt.zero_grad()
                crit(model(x), y).backward()
                if hessian is not None and step % 10 == 0:
                    hessian()
                opt.step()
    return info.value


@pytest.mark.parametrize("kw", [{}, {"guard_optimizer": True}], ids=["after-update", "guard"])
def test_sophia_with_eps_0_gets_its_own_hint_not_adams_formula(out_dir, kw):
    """SophiaG with eps=0 and a feature 0 in every record: the column of embed.weight that
    reads it has m = h = 0, so m.abs() / (rho * h + eps) is 0/0 at the first update. The hint
    was Adam's ('m = v = 0, so m / (sqrt(v) + eps) ... the default 1e-8'), a formula and a
    default this optimizer does not have."""
    err = _train(out_dir, lambda g: SophiaG(g, lr=1e-3), "make_sophia", dead=5, **kw)
    rep = nanreplay_json(err.bundle_path, "--try", "eps=1e-8", code=None)
    assert rep["event"]["step"] == 0 and rep["cause"] == "optimizer", rep
    assert rep["origin"]["param"] == "embed.weight", rep["origin"]
    hint = rep["hint"]
    assert "SophiaG's update at step 0 made" in hint, hint
    assert "sqrt(v)" not in hint and "m = v = 0" not in hint, hint
    assert "estimate of exactly 0, so the update divides 0 by 0" in hint, hint
    if kw:
        assert rep["reproduced"] and rep["origin"]["op"] == "aten.div", rep["origin"]
        assert [(t["try"], t["finite"]) for t in rep["what_if"]] == [("eps=1e-8", True)]


@pytest.mark.parametrize("kw", [{}, {"guard_optimizer": True}], ids=["after-update", "guard"])
def test_hugging_face_adafactor_with_eps1_0_and_relative_step(out_dir, kw):
    """Hugging Face's Adafactor copied into a repo, lr=None (relative step sizes) and eps1=0:
    the dead feature's column of embed.weight has a column second moment of 0, rsqrt(0) = inf,
    inf * 0 = NaN. --try auto crashed (float(None) on the lr); the hint read the ring's NaN
    placeholder for lr=None as 'its lr was nan', or blamed torch.optim.Adafactor's eps1 squared
    (this one adds eps1), and auto proposed lr=0.1x, which raised TypeError in the update."""
    err = _train(out_dir, lambda g: HFAdafactor(g, eps=(0.0, 1e-3)), "make_adafactor", dead=5,
                 **kw)
    rep = nanreplay_json(err.bundle_path, "--try", "auto", code=None)
    assert rep["event"]["step"] == 0 and rep["cause"] == "optimizer", rep
    assert rep["origin"]["param"] == "embed.weight", rep["origin"]
    hint = rep["hint"]
    assert "estimate of exactly 0" in hint and "set eps > 0" in hint, hint
    assert "lr was" not in hint and "torch.optim.Adafactor" not in hint, hint
    assert "lr=0.1x" not in [t["try"] for t in rep["what_if"]], rep["what_if"]
    if kw:
        assert rep["reproduced"] and rep["origin"]["op"] == "aten.rsqrt", rep["origin"]
        tries = {t["try"]: t["finite"] for t in rep["what_if"]}
        assert tries == {"clip=1.0": False, "eps=1.2e-07": True}, tries


def test_shampoo_root_of_a_negative_rounded_eigenvalue_is_not_an_eps_0(out_dir):
    """Shampoo with eps=0: G G^T of a 32-row batch has rank < 32, eigh returns eigenvalues
    that rounding left slightly negative, and lam.pow(-0.25) is NaN. The hint was the eps=0
    division text (Adam's m / (sqrt(v) + eps) before) and with any domain text LAMB's trust
    ratio; it names the negative base and clamping the eigenvalues."""
    err = _train(out_dir, Shampoo, "make_shampoo", guard_optimizer=True)
    rep = nanreplay_json(err.bundle_path)
    assert rep["event"]["step"] == 0 and rep["cause"] == "optimizer", rep
    assert rep["reproduced"] and rep["origin"]["param"] == "embed.weight", rep["origin"]
    assert rep["origin"]["op"] == "aten.pow", rep["origin"]
    hint = rep["hint"]
    assert "aten.pow of a negative number" in hint and "lam.clamp_min(eps)" in hint, hint
    assert "with eps=0" not in hint and "LAMB" not in hint, hint
