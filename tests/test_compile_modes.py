"""``torch.compile`` the ways users call it beyond ``torch.compile(model)``'s defaults
(``fullgraph_models``): ``fullgraph=True`` (no graph break allowed, so a recorder hook that
dynamo had to break the graph for would fail the training), the in-place ``model.compile()``
with ``dynamic=True`` over batches of varying size, a loss compiled alone next to a submodule
kept eager by ``torch.compiler.disable``, and the forward compiled and called on its own. The
planted bug: sample ``ROW`` of step ``K`` has no positive feature, so ``CountNorm`` divides 0
by a count of 0. Healthy runs train bit-identically with and without the recorder."""

from __future__ import annotations

import contextlib
import logging

import fullgraph_models as M
import pytest
import torch
from bundles import nanreplay_json, source_line
from torch import nn
from torch._dynamo.utils import counters

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")

K, ROW, STEPS = 2, 3, 4
BACKEND = "aot_eager"  # dynamo and AOTAutograd as inductor sees them, without C++ builds
FACTORY = "fullgraph_models:make_net"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def plant(x):
    x[ROW] = -x[ROW].abs()  # BUG: no feature of this sample is positive: its count is 0


def train(compile_model, out_dir=None, planted=False, sizes=(8,) * STEPS, crit=None):
    """SGD over ``sizes``-sized batches; ``compile_model(model)`` returns what the loop calls.
    Returns the losses and the model."""
    model = M.make_net()
    call = compile_model(model)
    crit = nn.CrossEntropyLoss() if crit is None else crit
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = None if out_dir is None else FlightRecorder(model, opt, loss_fn=crit,
                                                      out_dir=out_dir, factory=FACTORY)
    losses = []
    with rec if rec is not None else contextlib.nullcontext():
        for step, n in enumerate(sizes):
            x, y = M.batch(step, n)
            if planted and step == K:
                plant(x)
            opt.zero_grad()
            loss = crit(call(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
    return losses, model


def same_training(compile_model, tmp_path, **kw):
    """The recorded run equals the bare one bit for bit, adds no graph break, writes nothing."""
    bare, bare_model = train(compile_model, **kw)
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    recorded, model = train(compile_model, tmp_path, **kw)
    assert [float(v) for v in recorded] == [float(v) for v in bare]
    for (name, a), b in zip(model.state_dict().items(), bare_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert dict(counters["graph_break"]) == breaks == {}
    assert not list(tmp_path.rglob("*.nan"))


def fire(compile_model, out_dir, **kw):
    with pytest.raises(NonFiniteError) as info:
        train(compile_model, out_dir, planted=True, **kw)
    return info.value


def assert_named_division(bundle):
    rep = nanreplay_json(bundle)
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == \
        ("forward", "norm", "aten.div", [ROW])
    assert rep["cause"] == "invalid" and rep["reproduced"] is True
    assert o["source"] == source_line("fullgraph_models.py", "return (x * active) / active")
    return rep


def test_fullgraph_compiled_model_records_without_breaking_the_graph(tmp_path):
    """``torch.compile(model, fullgraph=True)``: the recorder's hooks stay outside the graph,
    so dynamo compiles it whole with the recorder on and training is unchanged; the 0/0 is
    caught at its step and sample, and the eager replay names the op inside the graph."""
    def compile_model(model):
        return torch.compile(model, backend=BACKEND, fullgraph=True)

    same_training(compile_model, tmp_path / "healthy")
    err = fire(compile_model, tmp_path)
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"], ev["samples"]) == \
        (K, "forward", "", True, [ROW])
    assert_named_division(err.bundle_path)


def test_in_place_fullgraph_compile_with_dynamic_batch_sizes(tmp_path):
    """``model.compile(fullgraph=True, dynamic=True)`` over batches of 8, 5, 4 and 6 samples
    (the last, short batches of an epoch): no recompilation or graph break the recorder adds,
    and the planted sample, the last of the 4-sample batch, is the one named."""
    sizes = (8, 5, 4, 6)

    def compile_model(model):
        model.compile(backend=BACKEND, fullgraph=True, dynamic=True)
        return model

    same_training(compile_model, tmp_path / "healthy", sizes=sizes)
    ev = fire(compile_model, tmp_path, sizes=sizes).event
    assert (ev["step"], ev["phase"], ev["module"], ev["compiled"], ev["samples"]) == \
        (K, "forward", "", True, [ROW])


# (dynamo reads .grad of the compiled loss's non-leaf input when guarding it, recorder or not)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_disabled_submodule_of_an_eager_model_is_recorded_as_eager(tmp_path):
    """A submodule wrapped in ``torch.compiler.disable`` (kept out of compilation) next to a
    loss compiled alone with ``fullgraph=True``: ``disable`` wraps the module in the same
    ``OptimizedModule`` as ``torch.compile``, and the recorder took it for a compiled region:
    the event said "It is torch.compile'd: its layers are not recorded one by one" of a
    module that runs eagerly. It is now recorded as the eager module it is."""
    def compile_model(model):
        model.norm = torch.compiler.disable(model.norm)
        return model

    def crit():
        return torch.compile(nn.CrossEntropyLoss(), backend=BACKEND, fullgraph=True)

    same_training(compile_model, tmp_path / "healthy", crit=crit())
    err = fire(compile_model, tmp_path, crit=crit())
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == \
        (K, "forward", "norm", [ROW])
    assert not ev.get("compiled") and "torch.compile'd" not in str(err)
    rep = assert_named_division(err.bundle_path)
    assert rep["event"]["compiled"] is False


def test_forward_compiled_alone_says_what_to_compile_instead(tmp_path, caplog):
    """``fwd = torch.compile(model.forward, fullgraph=True)`` called by the loop skips
    ``nn.Module.__call__`` and so the recorder's hooks: no forward is recorded (dynamo traces
    the submodules' hooks into its graph, where they record nothing). Training is unchanged and
    the NaN gradients of step K still stop the update, but the replay blamed "the loop's own
    code" for the gradients (Reptile, gradient surgery). It now says the forward was compiled
    on its own and to compile the model instead."""
    def compile_model(model):
        return torch.compile(model.forward, backend=BACKEND, fullgraph=True)

    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        same_training(compile_model, tmp_path / "healthy")
    # (said while training, once: not the warning of a loop that trains a copy, Reptile's)
    said = [r.getMessage() for r in caplog.records if "optimizer.step() ran" in r.getMessage()]
    assert len(said) == 1 and "calls a compiled forward itself" in said[0] \
        and "Compile the model instead" in said[0], said
    ev = (err := fire(compile_model, tmp_path)).event
    assert (ev["step"], ev["phase"]) == (K, "backward")
    rep = nanreplay_json(err.bundle_path, code=1)
    assert rep["cause"] == "not_reproduced"
    assert any("torch.compile(model.forward)" in p for p in rep["problems"]), rep["problems"]
    assert rep["hint"].startswith("compile the model instead of its forward")
