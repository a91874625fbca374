"""A decomposition failing inside ``optimizer.step()``: a hand-written Shampoo's Cholesky of a
preconditioner accumulated without damping, or of one a huge gradient's ``G G^T`` overflowed.
Torch's ``LinAlgError`` reached the loop with no bundle and no note, even with
``guard_optimizer=True`` (the pre-hook had closed the step's tape)."""

from __future__ import annotations

import optimizer_linalg_models as OL
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn

from recorder import FlightRecorder
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, make_opt, factory: str, **data):
    """Losses of a loop over ``OL.batches(**data)``; under the recorder when ``out_dir``."""
    model = OL.make_model()
    opt, crit, losses = make_opt(model.parameters()), nn.CrossEntropyLoss(), []

    def loop():
        for x, y in OL.batches(**data):
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    if out_dir is None:
        loop()
        return losses, None
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"optimizer_linalg_models:{factory}", **data.pop("kw", {})) as rec:
        loop()
    return losses, rec


def _failed(out_dir, guard: bool, **data) -> tuple[torch.linalg.LinAlgError, dict, dict]:
    """Train the undamped Shampoo until its Cholesky raises: the exception as the loop got
    it, the bundle's event and the replay's report of the one bundle written."""
    with pytest.raises(torch.linalg.LinAlgError) as info:
        _train(out_dir, OL.CholeskyShampoo, "make_shampoo", kw={"guard_optimizer": guard},
               **data)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and "failed inside optimizer.step()" in notes[0], notes
    bundles = sorted(out_dir.glob("*.nan"))
    assert len(bundles) == 1 and str(bundles[0]) in notes[0], (bundles, notes)
    return info.value, read_bundle(bundles[0])[0]["event"], nanreplay_json(bundles[0])


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_cholesky_of_a_preconditioner_without_damping(out_dir, guard):
    """A feature 0 in every record: the first layer's gradient has a 0 column, so its R
    (sum of G^T G, started at 0 * I) has that row and column exactly 0 and Cholesky refuses it
    at the preconditioner's first use. The event is the update of that step, the matrix
    finite: invalid, with the row named and damping as the fix."""
    dead = 2
    err, ev, rep = _failed(out_dir, guard, dead=dead)
    assert f"at step {OL.START} " in err.__notes__[0], err.__notes__
    o = rep["origin"]
    assert (ev["step"], ev["phase"], ev["reason"]) == (OL.START, "optimizer", "linalg"), ev
    assert ev["partly_updated"] is not guard, ev
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    assert o["params"] == ["0.weight"] and o["op"] == "aten.linalg_cholesky_ex", o
    assert o["source"] == source_line("optimizer_linalg_models.py", 'cholesky(st["R"])'), o
    assert f"row [{dead}] exactly 0" in rep["hint"] and "damping" in rep["hint"], rep["hint"]
    partly = [p for p in rep["problems"] if "guard_optimizer=False" in p]
    assert bool(partly) is not guard, rep["problems"]


def test_gradient_overflow_in_the_preconditioner(out_dir):
    """A corrupt record 1e22 times the others at step 4: the first layer's gradient reaches
    ~1e20 (finite), G G^T overflows float32 to inf and Cholesky refuses the inf matrix. The
    replay names the mm of grad @ grad.T at the optimizer's line, not the decomposition."""
    at = OL.START + 1  # (damped, so only the huge gradient breaks it)
    with pytest.raises(torch.linalg.LinAlgError) as info:
        _train(out_dir, lambda ps: OL.CholeskyShampoo(ps, eps=1e-3), "make_damped_shampoo",
               huge_at=at, kw={"guard_optimizer": True})
    assert f"at step {at} " in info.value.__notes__[0], info.value.__notes__
    bundle = next(out_dir.glob("*.nan"))
    ev, rep = read_bundle(bundle)[0]["event"], nanreplay_json(bundle)
    o = rep["origin"]
    assert (ev["step"], ev["phase"], ev["reason"]) == (at, "optimizer", "linalg"), ev
    assert rep["reproduced"] and rep["cause"] == "overflow", rep
    assert (o["op"], o["made"], o["params"]) == ("aten.mm", "+inf", ["0.weight"]), o
    assert o["source"] == source_line("optimizer_linalg_models.py", "grad @ grad.T"), o
    assert "clip the gradients" in rep["hint"], rep["hint"]
    # what-ifs re-run that update too: the decomposition it raises again is the event's
    # outcome, not a replay stage that failed; without the corrupt record it trains on
    tries = nanreplay_json(bundle, "--try", "dtype=float64", "--try", f"drop={OL.HUGE_ROW}",
                           code=None)
    assert "failed_stage" not in tries, tries["failed_stage"]
    wide, dropped = tries["what_if"]
    assert (wide["finite"], wide["origin"]["step"], wide["origin"]["kind"]) == \
        (False, at, "linalg"), wide
    assert dropped["finite"] and dropped["event_step"] is None, dropped


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_healthy_shampoo_is_bit_identical_under_the_recorder(out_dir, guard):
    """The damped Shampoo trains past its preconditioner's first use: the same losses, bit for
    bit, with and without the recorder, and no event."""
    def make(ps):
        return OL.CholeskyShampoo(ps, eps=1e-3)
    plain, _ = _train(None, make, "make_damped_shampoo")
    recorded, rec = _train(out_dir, make, "make_damped_shampoo", kw={"guard_optimizer": guard})
    assert len(plain) == 6 and recorded == plain
    assert rec.event is None and not list(out_dir.glob("*.nan"))
