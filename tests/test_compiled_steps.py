"""Training steps compiled the ways current loops write them, beyond ``torch.compile(model)``
(``test_compiled``, ``test_compile_modes``): the whole step compiled with dynamo tracing its
``loss.backward()`` (``trace_autograd_ops``, the setting dynamo's graph-break hint names), a
backward run by compiled autograd, and ``model.compile()`` called after the recorder attached.
Planted bugs (``replay_models``): sample ``ROW`` of step ``K`` scaled up under LogNet's log, or
zeroed under LengthNet's sqrt (a backward-only NaN)."""

from __future__ import annotations

import contextlib

import pytest
import replay_models as R
import torch
from torch import nn
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters

from recorder import FlightRecorder, NonFiniteError
from replay import replay

pytestmark = [pytest.mark.usefixtures("in_tests_dir"),
              pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not")]

K, ROW, STEPS = 2, 5, 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def train(make, step_of, out_dir=None, plant=None, steps=STEPS, losses=None):
    """SGD over ``steps`` batches, each run by ``step_of(model, opt, crit)(x, y)``; returns
    the losses (appended to ``losses`` as they come) and the model."""
    torch.manual_seed(0)
    model = getattr(R, make)()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    step = step_of(model, opt, crit)
    rec = None if out_dir is None else FlightRecorder(
        model, opt, loss_fn=crit, out_dir=out_dir, factory=f"replay_models:{make}")
    losses = [] if losses is None else losses
    with rec if rec is not None else contextlib.nullcontext():
        for i in range(steps):
            x, y = R.batch(i)
            if plant is not None and i == K:
                plant(x)
            losses.append(float(step(x, y)))
    return losses, model


def whole_step(model, opt, crit):
    @torch.compile(backend="eager")
    def train_step(x, y):
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return train_step


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanreplay"]


def test_a_backward_dynamo_traces_after_the_recorder_split_the_step_is_said(tmp_path, caplog):
    """``trace_autograd_ops=True`` with forward, loss, backward and update in one compiled
    function: the recorder's hooks split it after the model's call, and the backward dynamo
    traces in the graph resumed there wrote no gradient, so nothing trained, silently. The
    first step's update now says why and what to do."""
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        bare, _ = train("make_log_net", whole_step, steps=2)
        torch._dynamo.reset()
        with caplog.at_level("WARNING", logger="nanreplay"):
            recorded, model = train("make_log_net", whole_step, tmp_path, steps=2)
    untrained = [p.grad is None for p in model.parameters()]
    assert all(untrained)  # (torch's: if it ever writes them, the warning below goes too)
    msgs = said(caplog)
    assert len(msgs) == 1 and "trace_autograd_ops" in msgs[0], msgs
    assert "outside the compiled function" in msgs[0]
    assert recorded[0] == bare[0] and recorded[1] != bare[1]  # what the warning is about


def test_trace_autograd_ops_with_the_model_compiled_alone_trains_the_same_and_says_nothing(
        tmp_path, caplog):
    """The same switch where only the model is compiled (backward eager): no split of any
    traced backward, bit-identical training, no warning."""
    def compiled_model(model, opt, crit):
        m = torch.compile(model, backend="eager")

        def train_step(x, y):
            opt.zero_grad()
            loss = crit(m(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return train_step

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        bare, _ = train("make_log_net", compiled_model, steps=2)
        torch._dynamo.reset()
        with caplog.at_level("WARNING", logger="nanreplay"):
            recorded, _ = train("make_log_net", compiled_model, tmp_path, steps=2)
    assert recorded == bare
    assert not said(caplog)


def test_compiled_step_that_ran_without_the_recorder_is_recorded_once_it_attached(tmp_path):
    """The whole step compiled and run first without the recorder (a baseline, an earlier fold,
    a notebook cell run again), then with it: dynamo reused the step's code, traced without
    the recorder's hooks, so no forward was recorded ("optimizer.step() ran with no forward
    ... as Reptile's fast weights") and step K's NaN was caught late, at the gradients, replayed
    as "written by the loop's own code". Attaching drops that code: step K's forward event,
    replayed to the log on its sample; the steps before it train as the bare run did."""
    bare, _ = train("make_log_net", whole_step)
    recorded = []
    with pytest.raises(NonFiniteError) as info:
        train("make_log_net", whole_step, tmp_path, plant=scale_row, losses=recorded)
    assert recorded == bare[:K]
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["compiled"]) == \
        (K, "forward", "", [ROW], True)
    rep = replay(info.value.bundle_path)
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["origin"]["samples"]) == \
        ("act", "aten.log", [ROW])
    assert rep["cause"] == "invalid" and rep["reproduced"] is True


def compiled_autograd_step(model, opt, crit):
    """The model compiled, its backward run by compiled autograd (``_enable``, the context
    ``torch._dynamo.config.compiled_autograd`` enters around a compiled function's backward)."""
    m = torch.compile(model, backend="eager")

    def train_step(x, y):
        opt.zero_grad()
        loss = crit(m(x), y)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
        opt.step()
        return loss.detach()
    return train_step


def zero_row(x):
    x[ROW] = 0.0  # BUG: an all-zero record: LengthNet's sqrt at 0 has an infinite derivative


def test_backward_nan_under_compiled_autograd_is_caught_at_its_step(tmp_path):
    """The gradient hooks run under compiled autograd, the model compiled in the loop (the
    recorder given the module itself), after a run without the recorder in the same process:
    its compiled code, which dynamo reused, ran the model without the recorder's hooks, so the
    bundle held no layer and the replay blamed the factory ("builds a different model").
    Attaching drops it: the steps before the plant train bit-identically to the bare run, and
    the backward-only NaN is caught at step K, before its update, and replayed to the sqrt on
    the zeroed sample."""
    bare, _ = train("make_length_net", compiled_autograd_step, steps=K)
    recorded = []
    with pytest.raises(NonFiniteError) as info:
        train("make_length_net", compiled_autograd_step, tmp_path, plant=zero_row,
              losses=recorded)
    assert recorded == bare  # (steps 0..K-1: the event raised in step K's update)
    ev = info.value.event
    assert (ev["step"], ev["phase"]) == (K, "backward")
    rep = replay(info.value.bundle_path)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("backward", "feat", "SqrtBackward0", [ROW])
    assert rep["cause"] == "invalid" and rep["reproduced"] is True


def test_model_compiled_in_place_after_the_recorder_attached(tmp_path):
    """``model.compile()`` at the first batch, after the recorder attached (a loop that
    compiles lazily): the recorded run trains bit-identically without a graph break, and step
    K's NaN is named in the compiled model, replayed eagerly to the log on its sample."""
    def lazily_compiled(model, opt, crit):
        def train_step(x, y):
            if not compiled_in_place(model):
                model.compile(backend="eager")
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return train_step

    bare, _ = train("make_log_net", lazily_compiled)
    torch._dynamo.reset()
    recorded, _ = train("make_log_net", lazily_compiled, tmp_path)
    assert recorded == bare and not counters["graph_break"]
    with pytest.raises(NonFiniteError) as info:
        train("make_log_net", lazily_compiled, tmp_path / "fire", plant=scale_row)
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["compiled"]) == \
        (K, "forward", "", [ROW], True)
    rep = replay(info.value.bundle_path)
    assert (rep["origin"]["module"], rep["origin"]["op"], rep["origin"]["samples"]) == \
        ("act", "aten.log", [ROW])
    assert rep["cause"] == "invalid"


def compiled_in_place(model: nn.Module) -> bool:
    return getattr(model, "_compiled_call_impl", None) is not None


def scale_row(x):
    x[ROW] *= 100.0  # BUG: an unscaled record: LogNet's shifted log goes below 0
