"""Hand-copied optimizers whose own estimate divides by sums of lr-scaled terms, trained from a
warm-up that starts at a learning rate of 0 (``zero_rate_models``: Prodigy with tensor sums
and no ``d_denom == 0`` check), and Muon without its Newton-Schulz eps under the same warm-up,
whose 0/0 no rate changes; healthy runs with validation inside the epoch against the same loop
without the recorder."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import modern_optimizers_models as M
import pytest
import torch
import zero_rate_models as Z
from bundles import line_number, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

WARMUP = 4  # LambdaLR(s / WARMUP): the rate of step 0 is 0


def _train(model, opt, factory: str | None, out_dir, warm: bool, record: bool = True,
           **kw) -> list[float]:
    """modded-nanogpt's MLP trained one epoch, the scheduler stepped per batch, a no-grad
    validation batch every third step (schedule-free's ``optimizer.eval()`` swaps around it);
    the losses, training and validation, in order."""
    crit, losses, swaps = nn.CrossEntropyLoss(), [], hasattr(opt, "eval")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / WARMUP)) \
        if warm else None
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw) \
        if record else contextlib.nullcontext()
    with rec:
        for i, (x, y) in enumerate(M.loader(n=192)):
            model.train()
            if swaps:
                opt.train()
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if sched is not None:
                sched.step()
            if i % 3 == 2:
                model.eval()
                if swaps:
                    opt.eval()
                with torch.no_grad():
                    x, y = next(iter(M.loader(n=64, batch_size=64)))
                    losses.append(crit(model(x), y).item())
    return losses


@pytest.mark.parametrize("kw", [{"guard_optimizer": True}, {"rewind": 2}],
                         ids=["guard", "window"])
def test_prodigy_s_d_at_a_warm_up_s_rate_of_0_is_told_by_its_rate(out_dir, kw):
    """At the warm-up's first step every lr is 0, so Prodigy's sums of lr-scaled terms are 0
    and d = d_numerator / d_denom is 0/0: every parameter's update is NaN at step 0. The hint
    said a count over the batch was 0 and LAMB's trust ratio, and --try auto proposed
    nothing; the update is re-run at the schedule's base rate, finite, and the rate named.
    The window's re-run under the op finder kept the group's d its first run left NaN and
    named a mul of the sums (line above) instead of the division."""
    model = M.make_model()
    opt = Z.TensorSumProdigy(model.parameters(), lr=1.0)
    with pytest.raises(NonFiniteError) as info:
        _train(model, opt, "zero_rate_models:make_prodigy", out_dir, warm=True, **kw)
    ev = info.value.event
    names = [n for n, _ in model.named_parameters()]
    assert (ev["step"], ev["phase"], ev["params"], ev["samples"]) == \
        (0, "optimizer", names, []), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["param"], o["op"], o["made"]) == \
        (True, "optimizer", names[0], "aten.div", "nan"), o
    line = line_number("zero_rate_models.py", "d_hat = (d_numerator / d_denom)")
    assert o["source"] == f"zero_rate_models.py:{line}", o
    hint = rep["hint"]
    assert "aten.div of 0 by 0 (0/0), with every param group's lr 0" in hint, hint
    assert "re-run from the same state at lr=1 is finite" in hint, hint
    assert "if d_denom == 0: return" in hint, hint
    assert "LAMB" not in hint and "batch's samples" not in hint, hint
    assert {t["try"]: t["finite"] for t in rep["what_if"]} == {"lr=1": True}, rep["what_if"]
    if "rewind" in kw:
        assert (rep["window"]["reproduced"], rep["window"]["event_step"]) == (True, 0), rep


def test_muon_s_0_over_0_at_a_rate_of_0_is_not_blamed_on_the_rate(out_dir):
    """Muon's X / X.norm() (eps dropped) of c_fc's all-zero gradient at step 0, under the same
    warm-up: the update re-run at the base rate is NaN too, so the hint keeps the zero
    gradient and the zero-initialised c_proj, and --try auto proposes no rate."""
    model = M.make_model()
    opt = M.MuonWithAuxAdam(M.muon_groups(model), ns_eps=0.0)
    with pytest.raises(NonFiniteError) as info:
        _train(model, opt, "modern_optimizers_models:make_muon0", out_dir, warm=True,
               guard_optimizer=True)
    ev = info.value.event
    c_fc = [n for n, _ in model.named_parameters() if n.endswith("c_fc.weight")]
    assert (ev["step"], ev["phase"], ev["params"]) == (0, "optimizer", c_fc), ev
    rep = nanreplay_json(info.value.bundle_path, "--try", "auto")
    o = rep["origin"]
    assert (rep["reproduced"], rep["cause"], o["op"]) == (True, "optimizer", "aten.div"), o
    hint = rep["hint"]
    assert "lr 0" not in hint and "d_denom" not in hint, hint
    assert f"{c_fc[0]}'s gradient was exactly 0 in every element at step 0" in hint, hint
    assert not [t for t in rep.get("what_if") or [] if t["try"].startswith("lr=")], rep


HEALTHY = {
    "prodigy-tensor-sums": lambda m: Z.TensorSumProdigy(m.parameters(), lr=1.0),
    # optimizer.eval() / train() rewrite every weight between steps, inside the epoch
    "schedule-free": lambda m: M.AdamWScheduleFree(m.parameters(), lr=0.01, warmup_steps=3),
    "muon-aux-adam": lambda m: M.MuonWithAuxAdam(M.muon_groups(m)),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_runs_train_bit_identically_with_no_event(out_dir, caplog, name):
    plain = M.make_model()
    bare = _train(plain, HEALTHY[name](plain), None, out_dir, warm=False, record=False)
    model = M.make_model()
    with caplog.at_level(logging.WARNING):
        recorded = _train(model, HEALTHY[name](model), "modern_optimizers_models:make_model",
                          out_dir, warm=False, rewind=3)
    assert recorded == bare
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not list(Path(out_dir).glob("*.nan"))
