"""The model's own NaN check (``raise ValueError("NaN in ...")``, ``assert
torch.isfinite(x).all()``, a solver giving up on a step size that underflowed) raises inside
forward before any hook sees the value: the recorder still writes the step's bundle (the
``check`` event) and the replay names the op that made the value; an error that is no numeric
check writes none."""

from __future__ import annotations

import numeric_check_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line

from recorder import FlightRecorder
from recorder.bundle import read_bundle

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _train(out_dir, make: str = "make_model", steps: int = 5, data=M.batch, **plant):
    model = getattr(M, make)()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.MSELoss()
    losses = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory=f"numeric_check_models:{make}"):
        for step in range(steps):
            x, mask, y = data(step, **plant)
            opt.zero_grad()
            loss = crit(model(x, mask), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def _bundle(out_dir):
    (path,) = list(out_dir.glob("*.nan"))
    return path


def _reason(out_dir) -> str:
    return read_bundle(_bundle(out_dir), want=lambda name: False)[0]["event"]["reason"]


def test_a_modules_own_nan_check_writes_the_bundle_and_the_replay_names_the_softmax(tmp_path):
    with pytest.raises(ValueError, match="NaN in attention weights") as info:
        _train(tmp_path, masked_at=3)
    notes = getattr(info.value, "__notes__", [])
    assert any("step00000003" in n for n in notes), notes  # (the loop's error goes on, noted)
    rep = nanreplay_json(_bundle(tmp_path))
    assert (rep["event"]["step"], _reason(tmp_path)) == (3, "check"), rep["event"]
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["made"]) == (
        "forward", "attn", "aten._softmax", "nan"), o
    assert o["samples"] == [2], o
    assert o["source"] == source_line("numeric_check_models.py", "w = scores.softmax(-1)"), o
    assert rep["cause"] == "invalid" and "fully masked row" in rep["hint"], rep["hint"]
    raised = source_line("numeric_check_models.py", 'raise ValueError("NaN in attention')
    assert any(f"raised ValueError (NaN in attention weights) at {raised}" in p
               for p in rep["problems"]), rep["problems"]


def test_a_bare_assert_on_isfinite_is_a_check_and_names_the_log(tmp_path):
    """``assert torch.isfinite(log_var).all()`` raises an AssertionError with no message: its
    line says what it checks."""
    with pytest.raises(AssertionError):
        _train(tmp_path, make="make_log_scale")
    rep = nanreplay_json(_bundle(tmp_path))
    assert "assert torch.isfinite(log_var).all()" in rep["event"]["detail"], rep["event"]
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"]) == (0, "scale", "aten.log"), o
    assert o["source"] == source_line("numeric_check_models.py", "log_var = torch.log(var)"), o
    assert rep["cause"] == "invalid", rep["cause"]


def test_a_check_that_refuses_a_finite_value_names_its_line(tmp_path):
    """The integrator's step size underflows on a record 1e8 times too large, every value still
    finite: the bundle is written, and the report says the check refused a finite value."""
    with pytest.raises(RuntimeError, match="underflow in dt"):
        _train(tmp_path, make="make_euler", big_at=2)
    rep = nanreplay_json(_bundle(tmp_path))
    assert (rep["event"]["step"], _reason(tmp_path)) == (2, "check"), rep["event"]
    assert rep["cause"] is None and rep["reproduced"], rep
    assert rep["origin"]["source"] == source_line(
        "numeric_check_models.py", 'raise RuntimeError(f"underflow in dt'), rep["origin"]
    assert "refused a finite one" in rep["hint"], rep["hint"]


def test_a_gradient_check_raising_in_backward_names_the_node(tmp_path):
    """A tensor hook the forward registers raises on a non-finite gradient (a blank record's
    length of 0 through sqrt): raised in backward, outside any module call, it still writes
    the bundle, and the replay names the backward node and the record; the float64 re-run,
    whose hook raises too, still tells the cause."""
    with pytest.raises(RuntimeError, match="non-finite gradient in the embedding"):
        _train(tmp_path, make="make_distances", data=M.flat_batch, blank_at=2)
    assert _reason(tmp_path) == "check"
    rep = nanreplay_json(_bundle(tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["op"], o["samples"]) == (
        2, "backward", "SqrtBackward0", [3]), o
    assert rep["cause"] == "invalid" and rep["reproduced"], rep["cause"]
    assert any("raised RuntimeError (non-finite gradient in the embedding)" in p
               for p in rep["problems"]), rep["problems"]


def test_torch_normal_refusing_a_nan_std_names_the_sqrt(tmp_path):
    """torch.normal's own check says 'normal expects all elements of std >= 0.0', no word of
    NaN: it is one of PyTorch's refusals all the same, and the replay names the sqrt of a
    negative variance."""
    with pytest.raises(RuntimeError, match="normal expects all elements of std"):
        _train(tmp_path, make="make_reparam", data=M.flat_batch)
    rep = nanreplay_json(_bundle(tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["module"], o["op"], o["made"]) == (0, "", "aten.sqrt", "nan"), o
    assert rep["cause"] == "invalid", rep["cause"]


def test_an_error_that_is_no_numeric_check_writes_no_bundle(tmp_path):
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        _train(tmp_path, make="make_shapes")
    assert not list(tmp_path.glob("*.nan"))
    assert not getattr(info.value, "__notes__", None)


def test_the_checks_change_nothing_in_a_healthy_run(tmp_path):
    losses = _train(tmp_path, steps=4)
    model = M.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    bare = []
    for step in range(4):
        x, mask, y = M.batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x, mask), y)
        loss.backward()
        opt.step()
        bare.append(loss.item())
    assert losses == bare and not list(tmp_path.glob("*.nan"))


def test_multinomial_refusing_nan_probabilities_names_the_temperature_division(tmp_path):
    """A temperature annealed to 0: logits / 0 is inf, softmax NaN, and torch.multinomial's
    own check raises 'probability tensor contains either inf, nan or element < 0' inside the
    policy's forward: the bundle is written and the replay names the division."""
    model = M.make_policy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        with FlightRecorder(model, opt, out_dir=tmp_path,
                            factory="numeric_check_models:make_policy") as rec:
            for step in range(5):
                g = torch.Generator().manual_seed(step)
                obs, adv = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
                loss = -(model(obs, torch.tensor(0.0 if step == 3 else 1.0)) * adv).mean()
                rec.record_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    rep = nanreplay_json(_bundle(tmp_path))
    o = rep["origin"]
    assert (rep["event"]["step"], o["phase"], o["module"], o["op"], o["made"]) == (
        3, "forward", "", "aten.div", "+inf"), o
    assert o["source"] == source_line("numeric_check_models.py", "self.fc(obs) / temperature"), o
    assert rep["cause"] == "invalid", rep["cause"]
