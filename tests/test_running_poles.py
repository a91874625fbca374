"""Hints for poles the data reaches in its ordinary course (``running_pole_models``): a
running mean's ``cumsum(mask)`` divisor in the loss, 0 before a row's first valid position,
gets the cumulative-sum sentence the model's forward got (it got none in the loss); a time
``t ~ U[0, 1]`` drawn at 0 under ``1 / t`` or ``sqrt`` is a legal value to make the op safe at,
not a record to fix or filter (which it was called), while a 0 far below the other samples'
values (a price of 0) is still a bad record."""

from __future__ import annotations

import json

import pytest
import running_pole_models as M
import torch
from bundles import nanreplay_json
from torch.nn import functional as F

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")
PLANT, ROW = 1, 2


def _line(text: str) -> str:
    with open(M.__file__) as f:
        lines = f.read().splitlines()
    return f"running_pole_models.py:{next(i for i, s in enumerate(lines, 1) if text in s)}"


def _sequences(tmp_path, recorder=True, lead=0):
    torch.manual_seed(0)
    model, g = M.SeqHead(), torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with FlightRecorder(model, opt, loss_fn=M.running_mean_loss, out_dir=tmp_path,
                        factory="running_pole_models:SeqHead") if recorder else \
            _Bare(M.running_mean_loss) as rec:
        for step in range(3):
            x, y = torch.randn(4, 5, 3, generator=g), torch.rand(4, 5, generator=g) + 0.5
            if step == PLANT:
                y[ROW, :lead] = 0  # (a left-padded row: no valid position yet)
            opt.zero_grad()
            loss = rec.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


class _Bare:
    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_running_mean_over_a_left_padded_row_in_the_loss_names_its_cumsum(tmp_path):
    assert _sequences(tmp_path, recorder=False) == _sequences(tmp_path)
    assert not list(tmp_path.glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        _sequences(tmp_path, lead=2)
    rep = nanreplay_json(info.value.bundle_path)
    o, hint = rep["origin"], rep["hint"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["samples"],
            rep["cause"]) == (PLANT, "loss", "<loss>", "aten.div", [ROW], "invalid"), \
        json.dumps(rep, indent=1)
    assert o["source"] == _line("running = torch.cumsum"), o["source"]
    assert f"cumulative sum (at {_line('running = torch.cumsum')})" in hint, hint
    assert "cumsum(mask).clamp_min(1)" in hint and "linear attention" not in hint, hint


def _diffusion(tmp_path, make, t0: float | None):
    torch.manual_seed(0)
    model, g = getattr(M, make)(), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with FlightRecorder(model, opt, loss_fn=F.mse_loss, out_dir=tmp_path,
                        factory=f"running_pole_models:{make}") as rec:
        for step in range(3):
            x, t = torch.randn(32, 4, generator=g), torch.rand(32, generator=g)
            if step == PLANT and t0 is not None:
                t[ROW] = t0
            opt.zero_grad()
            rec.loss_fn(model(x, t), x).backward()
            opt.step()


@pytest.mark.parametrize("make, op", [("InverseTime", "aten.reciprocal"),
                                      ("SqrtTime", "SqrtBackward0")])
def test_a_time_drawn_at_0_is_a_legal_value_to_make_the_op_safe_at(tmp_path, make, op):
    _diffusion(tmp_path, make, None)  # (healthy: no event)
    assert not list(tmp_path.glob("*.nan"))
    with pytest.raises(NonFiniteError) as info:
        _diffusion(tmp_path, make, 0.0)
    rep = nanreplay_json(info.value.bundle_path)
    o, hint = rep["origin"], rep["hint"]
    assert (rep["event"]["step"], o["samples"], rep["cause"]) == (PLANT, [ROW], "invalid"), \
        json.dumps(rep, indent=1)
    assert op in [o["op"]] + [c["op"] for c in o["chain"]], json.dumps(rep, indent=1)
    assert "legal draw" in hint and "not a broken record" in hint, hint
    assert "clamp_min" in hint and "+ eps" in hint, hint
    assert "bad record" not in hint and "blank record" not in hint, hint
    assert hint.index("+ eps") < hint.index("drop="), hint  # (dropping: a check, after)


def test_a_time_far_below_the_others_is_still_a_bad_record(tmp_path):
    """The same 1 / t with t in [100, 101) and one 0: 0 lies far outside the spread."""
    torch.manual_seed(0)
    model, g = M.InverseTime(), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as info, FlightRecorder(
            model, opt, loss_fn=F.mse_loss, out_dir=tmp_path,
            factory="running_pole_models:InverseTime") as rec:
        for step in range(3):
            x, t = torch.randn(32, 4, generator=g), torch.rand(32, generator=g) + 100
            if step == PLANT:
                t[ROW] = 0.0
            opt.zero_grad()
            rec.loss_fn(model(x, t), x).backward()
            opt.step()
    rep = nanreplay_json(info.value.bundle_path)
    assert (rep["event"]["step"], rep["origin"]["samples"]) == (PLANT, [ROW])
    assert "bad record" in rep["hint"] and "legal draw" not in rep["hint"], rep["hint"]
