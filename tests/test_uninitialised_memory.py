"""Memory allocated with ``torch.empty`` / ``new_empty`` and read before every entry was
written: a hand-written RNN unrolled into a preallocated output over a ragged batch, and
sequences padded into ``new_empty`` then pooled with a 0/1 mask multiplied in (NaN * 0 is NaN).
Under ``torch.use_deterministic_algorithms(True)`` the unwritten entries are NaN. Before, the
replay passed over allocations and named no op: 'nan made by <root>', op None, the forward's
``def`` line and the generic 'guard the op's domain' hint. Now it names the allocation, its
line, the samples whose entries were never written, ``invalid``, and how many entries were
left unwritten; a ``torch.empty`` written in full is not blamed for another op's NaN; and a
run without deterministic mode, whose garbage memory held NaN and whose re-runs disagree, is
told which allocation a NaN-filled re-run finds read unwritten."""

from __future__ import annotations

import inspect

import pytest
import torch
import uninit_models as M
from bundles import nanreplay_json, rewrite
from torch import nn

from recorder import FlightRecorder, NonFiniteError

K, ROW, B, T, SHORT = 3, 2, 6, 5, 3

pytestmark = pytest.mark.usefixtures("in_tests_dir")


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _line(fn, text: str) -> str:
    """``uninit_models.py:N`` of the line of ``fn`` holding ``text``."""
    src, first = inspect.getsourcelines(fn)
    n = next(i for i, line in enumerate(src) if text in line)
    return f"uninit_models.py:{first + n}"


def _batch(name: str, step: int, ragged: bool):
    lengths = torch.full((B,), T)
    if ragged and step == K:
        lengths[ROW] = SHORT
    if name == "make_ragged_rnn":
        return torch.randn(B, T, 3), lengths
    if name == "make_packed_pool":
        return torch.randn(int(lengths.sum()), 4), lengths
    x = torch.randn(B, 4)
    if ragged and step == K:
        x[ROW, 0] = -200.0  # log(2x + 10) of a negative number
    return (x,)


def _train(factory, out_dir=None, ragged=True, steps=K + 2):
    torch.manual_seed(0)
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    losses = []
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory=f"uninit_models:{factory.__name__}") if out_dir else None
    with rec if rec else _Nothing():
        for step in range(steps):
            args, y = _batch(factory.__name__, step, ragged), torch.randint(0, 2, (B,))
            opt.zero_grad()
            loss = crit(model(*args), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _event(factory, out_dir):
    with pytest.raises(NonFiniteError) as info:
        _train(factory, out_dir)
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "forward")
    return info.value.bundle_path


@pytest.mark.parametrize("factory, op, width", [
    (M.make_ragged_rnn, "aten.empty", 8),  # (hidden size)
    (M.make_packed_pool, "aten.new_empty", 4),  # (features)
])
def test_unwritten_entries_name_the_allocation(deterministic, out_dir, factory, op, width):
    rep = nanreplay_json(_event(factory, out_dir))
    o = rep["origin"]
    forward = type(factory()).forward
    line = _line(forward, "torch.empty(" if op == "aten.empty" else ".new_empty(")
    assert (o["phase"], o["module"], o["op"], o["samples"], o["source"]) == \
        ("forward", "", op, [ROW], line), o
    assert rep["reproduced"] and rep["cause"] == "invalid", rep
    # the short sequence's tail: (T - SHORT) steps of ``width`` values, of the whole buffer
    assert f"{(T - SHORT) * width} of {B * T * width} entries" in rep["hint"], rep["hint"]
    assert "never written" in rep["hint"] and "torch.zeros" in rep["hint"], rep["hint"]


def test_a_fully_written_empty_is_not_blamed_for_another_ops_nan(deterministic, out_dir):
    rep = nanreplay_json(_event(M.make_scratch_then_log, out_dir))
    o = rep["origin"]
    line = _line(M.ScratchThenLog.forward, "torch.log(")
    assert (o["module"], o["op"], o["samples"], o["source"]) == ("", "aten.log", [ROW], line), o
    assert rep["cause"] == "invalid" and "never written" not in rep["hint"], rep["hint"]


@pytest.mark.parametrize("factory", [M.make_ragged_rnn, M.make_packed_pool])
def test_full_batches_train_identically_with_the_recorder(deterministic, out_dir, factory):
    plain = _train(factory, ragged=False)
    recorded = _train(factory, out_dir, ragged=False)
    assert plain == recorded and all(map(torch.isfinite, torch.tensor(plain)))
    assert not out_dir.exists() or not list(out_dir.iterdir())


def test_garbage_of_a_run_without_deterministic_mode_is_named(deterministic, out_dir, tmp_path,
                                                              monkeypatch):
    """The event of a run whose ``torch.empty`` garbage held NaN (made here with deterministic
    mode, then recorded as off): the replay's fresh memory holds other garbage, finite as a
    fresh page's zeros (made so here by a wrapper of ``torch.empty``, whose line is then the
    allocation's: what garbage holds is no test's to choose), so the re-runs do not make the
    event, and the NaN-filled re-run names the allocation in the hint and says how to make the
    NaN come back."""
    made = _event(M.make_ragged_rnn, out_dir)
    torch.use_deterministic_algorithms(False)
    empty = torch.empty

    def finite_garbage(*args, **kwargs):  # (deterministic mode's fill stays as it is)
        t = empty(*args, **kwargs)
        return t if torch.are_deterministic_algorithms_enabled() or not t.is_floating_point() \
            else t.zero_()

    def off(meta):
        meta["env"]["deterministic_algorithms"] = False
        return meta

    monkeypatch.setattr(torch, "empty", finite_garbage)
    rep = nanreplay_json(rewrite(made, tmp_path / "off.nan", meta=off), code=1)
    src, first = inspect.getsourcelines(finite_garbage)
    line = f"test_uninitialised_memory.py:{first + 1}"  # (the wrapper's empty(...) line)
    assert src[1].strip() == "t = empty(*args, **kwargs)", src
    assert rep["cause"] == "not_reproduced", rep
    assert f"aten.empty at {line}" in rep["hint"], rep["hint"]
    assert "torch.use_deterministic_algorithms(True)" in rep["hint"], rep["hint"]
    assert [p for p in rep["problems"] if f"samples [{ROW}]" in p], rep["problems"]


def test_a_loss_reading_an_unwritten_weight_names_the_allocation(deterministic, out_dir):
    """Class weights assigned by label into ``torch.empty``, the label 0 of one record missed:
    a loss event, whose re-run of the loss names the allocation and that record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.05), M.ClassWeightedLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(K + 2):
                y = torch.randint(1, 3, (B,))
                if step == K:
                    y[ROW] = 0
                opt.zero_grad()
                crit(model(torch.randn(B, 4)), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (K, "loss")
    rep = nanreplay_json(info.value.bundle_path)
    o, line = rep["origin"], _line(M.ClassWeightedLoss.forward, "torch.empty(")
    assert (o["phase"], o["op"], o["samples"], o["source"]) == \
        ("loss", "aten.empty", [ROW], line), o
    assert rep["cause"] == "invalid" and f"1 of {B} entries" in rep["hint"], rep["hint"]


@pytest.mark.parametrize("factory, name, line_of", [
    (M.make_bilinear, "w", (M.Bilinear.__init__, "torch.empty(")),
    (M.make_centred, "scratch", (M.Centred.__init__, "torch.empty(")),
])
def test_a_weight_or_buffer_built_with_empty_names_the_allocation(
        deterministic, out_dir, factory, name, line_of):
    """``nn.Parameter(torch.empty(..))`` never initialised, and a scratch buffer whose rows past
    the first (smaller) batch are never written: the factory builds them NaN, the event is at
    step 0, and the hint names the allocation's line instead of a checkpoint or data."""
    torch.manual_seed(0)
    model = factory()
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"uninit_models:{factory.__name__}"):
            for step in range(2):
                n = B if step == 0 else 8  # (the first batch smaller than the buffer)
                opt.zero_grad()
                crit(model(torch.randn(n, 4)), torch.randint(0, 2, (n,))).backward()
                opt.step()
    assert info.value.event["step"] == 0
    rep = nanreplay_json(info.value.bundle_path)
    assert rep["cause"] == "weights", rep
    assert rep["hint"].startswith(f"the factory builds {name} non-finite: aten.empty at "
                                  f"{_line(*line_of)} allocated it"), rep["hint"]
    assert "never written" in rep["hint"], rep["hint"]
