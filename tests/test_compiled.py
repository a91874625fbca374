"""``torch.compile``'d models under the recorder, and their bundles replayed.

A compiled region (``torch.compile(m)``, ``m.compile()``, or a compiled submodule) is recorded
as one call whose hooks run outside dynamo's graphs, so the recorder adds no graph break and no
recompilation; the modules inside are not hooked. Names leave out the ``_orig_mod`` wrappers,
so the replay (which runs the model eagerly, whatever its factory returns) names the exact
module and op inside the region.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import replay_models as R
import torch
from torch import nn
from torch._dynamo.utils import counters

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

HERE = Path(__file__).parent
K = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.chdir(HERE)  # the factories' module is trusted from here
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _train(model, out_dir, steps: int = 6, **kwargs):
    """SGD on ``replay_models.batch`` with sample 5 of step K scaled up (LogNet's log goes
    NaN); returns the recorder and the error it raised."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **kwargs) as rec:
            for step in range(steps):
                x, y = R.batch(step)
                if step == K:
                    x[5] *= 100.0
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    return rec, info.value


def _names(path):
    meta, tensors = read_bundle(path)
    return ([m["name"] for m in meta["modules"]],
            sorted(k.split("/", 1)[1] for k in tensors if k.startswith("weights/")))


CLEAN = (["", "lin", "act", "head"], ["head.bias", "head.weight", "lin.bias", "lin.weight"])


def test_compiled_model_recorded_as_one_call_and_replayed_eagerly(tmp_path):
    model = R.make_compiled_log_net()  # inductor, as a training script compiles
    rec, err = _train(model, tmp_path, factory="replay_models:make_compiled_log_net")
    ev = err.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (K, "forward", "", "nan", [5])
    assert ev["compiled"] is True and "torch.compile'd" in str(err)
    assert not counters["graph_break"], dict(counters["graph_break"])  # hooks stay outside
    assert counters["stats"]["unique_graphs"] == 1  # as without the recorder: no recompile
    assert _names(err.bundle_path) == CLEAN
    rep = replay(err.bundle_path)  # the factory returns a compiled model: replayed eagerly
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == ("forward", "act", "aten.log", [5])
    assert rep["event"]["compiled"] is True
    from replay.report import to_text

    assert "  recorded   '<root>' as one torch.compile'd call; this replay ran its layers " \
        "eagerly" in to_text(rep).splitlines()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_model_compiled_in_place(tmp_path):
    """``model.compile()`` traces the root's own hooks: the recorder's run disabled for dynamo
    (eagerly, outside the graph), and they all go at detach."""
    net = R.LogNet()
    net.compile(backend="aot_eager")
    rec, err = _train(net, tmp_path, factory="replay_models:make_log_net")
    assert (err.event["step"], err.event["module"], err.event["compiled"]) == (K, "", True)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert _names(err.bundle_path) == CLEAN
    assert _hooks(net) == 0  # detached
    rep = replay(err.bundle_path)
    assert rep["event"]["step"] == K and rep["cause"] == "invalid"
    assert rep["reproduced"] is True and rep["origin"]["module"] == "act"
    assert rep["origin"]["op"] == "aten.log" and rep["origin"]["samples"] == [5]


# dynamo reads .grad of the block's (non-leaf) input when guarding it, recorder or not; the
# warning it hides is an error under this suite's filterwarnings
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_submodule_keeps_per_layer_records_around_it(tmp_path):
    """A compiled block is one call; the layers around it are recorded as usual, and the first
    non-finite output is the block's."""
    net = R.LogNet()
    net.act = torch.compile(net.act, backend="aot_eager")
    rec, err = _train(net, tmp_path, factory="replay_models:make_log_net")
    ev = err.event
    assert (ev["step"], ev["module"], ev["compiled"], ev["inputs_finite"]) == (K, "act", True, True)
    assert rec.target.module_names == CLEAN[0]
    assert _names(err.bundle_path) == CLEAN
    meta, tensors = read_bundle(err.bundle_path)
    called = [meta["modules"][m]["name"] for m, _ in meta["call_order"]]
    assert called == ["lin", "act", "head", ""]  # every hooked call, in order
    rep = replay(err.bundle_path)
    assert rep["event"]["step"] == K and rep["cause"] == "invalid"
    assert rep["reproduced"] is True and rep["origin"]["module"] == "act"
    assert (rep["origin"]["call"], rep["origin"]["op"]) == (0, "aten.log")


def test_compiled_model_validation_and_sync_budget(tmp_path):
    """The mode is read from the model as written (``net.eval()`` does not reach the compile
    wrapper), and a compiled step costs one host read, as an eager one."""
    from test_recorder_sync import count_host_reads

    net = R.LogNet()
    model = torch.compile(net, backend="aot_eager")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=True)  # no .item() of its own
    crit = nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path) as rec:
        for step in range(2):  # compile before counting
            x, y = R.batch(step)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        with count_host_reads() as reads:
            for step in range(2, 5):
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
        assert len(reads) == 3, reads
        net.eval()
        x, y = R.batch(9)
        x[1, 0] = float("nan")
        with torch.no_grad(), pytest.raises(NonFiniteError) as info:
            model(x)
    assert info.value.event.get("evaluation") is True and rec.step == 5


def test_compiled_dropout_replays_its_draw_with_fallback_random(tmp_path):
    """Inductor draws dropout masks with its own generator unless ``fallback_random`` is set;
    with it, the eager replay restores the recorded RNG state and gets the compiled step's
    mask: the NaN (0 * log 0 where dropout zeroed an element) is on the same rows."""
    from torch._inductor import config

    model = torch.compile(R.DropoutNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with config.patch(fallback_random=True), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_dropout_net"):
            for step in range(30):
                x, y = R.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    ev = info.value.event
    assert ev["compiled"] is True and ev["samples"]
    rep = replay(info.value.bundle_path)
    assert rep["event"]["step"] == ev["step"] and rep["cause"] == "invalid"
    assert rep["reproduced"] is True and rep["origin"]["module"] == "ent"
    assert rep["origin"]["op"] == "aten.log" and rep["origin"]["samples"] == ev["samples"]


def test_a_compiled_only_nan_is_not_reproduced_and_says_why(tmp_path):
    """A NaN that only the compiled kernels make does not come back in the eager replay: the
    report says not reproduced and names compilation as the likely reason. (Simulated: the
    recorded batch is replaced by one the model turns into finite values.)"""
    from bundles import rewrite

    model = torch.compile(R.LogNet(), backend="aot_eager")
    _, err = _train(model, tmp_path, factory="replay_models:make_log_net")
    (key,) = read_bundle(err.bundle_path)[0]["micro_batches"][0]["paths"]
    finite = rewrite(err.bundle_path, tmp_path / "x" / "finite.nan",
                     tensors=lambda t: {**t, key: R.batch(K)[0]})
    rep = replay(finite)
    assert rep["event"]["step"] == K
    assert rep["reproduced"] is False and rep["cause"] == "not_reproduced"
    assert any("torch.compile'd module and the replay runs it eagerly" in p
               for p in rep["problems"]), rep["problems"]


# (dynamo's own, wrapping the step's non-leaf tensors, as without the recorder)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_training_step_is_recorded_with_its_model_as_one_call(tmp_path):
    """``torch.compile`` of the whole training step (forward, loss, backward and
    ``optimizer.step()`` in one function, as speed-minded loops write it): dynamo traced the
    recorder's hooks, so no step ever opened, the NaN trained on unseen, and the ``with``
    block's exit blamed "step -1". The root's, the loss's and the optimizer's hooks run
    eagerly, the model's layers in the step's graphs are one compiled call, and the replay
    names the op inside it."""
    model = R.make_log_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()

    @torch.compile(backend="eager")
    def train_step(x, y):
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_log_net") as rec:
            for step in range(6):
                x, y = R.batch(step)
                if step == K:
                    x[5] *= 100.0
                train_step(x, y)
                assert rec.step == step + 1  # each step opened and closed
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["kind"], ev["samples"]) == \
        (K, "forward", "", "nan", [5])
    assert ev["compiled"] is True
    assert all(p.isfinite().all() for p in model.parameters())  # stopped before the update
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    o = rep["origin"]
    assert (o["phase"], o["module"], o["op"], o["samples"]) == ("forward", "act", "aten.log", [5])


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_model_called_from_a_compiled_training_step_is_recorded(tmp_path):
    """``torch.compile(model)`` called inside a ``torch.compile``'d training step: dynamo runs
    the wrapped module's graph without calling the wrapper, whose hooks the recorder used, so
    nothing was recorded, silently (``rec.step`` stayed 0). The module inside the wrapper is
    hooked instead, its hooks disabled for dynamo, as for ``model.compile()``."""
    net = R.LogNet()
    model = torch.compile(net, backend="eager")
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()

    @torch.compile(backend="eager")
    def train_step(x, y):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path,
                            factory="replay_models:make_log_net") as rec:
            for step in range(6):
                x, y = R.batch(step)
                if step == K:
                    x[5] *= 100.0
                train_step(x, y)
                assert rec.step == step + 1
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"], ev["compiled"]) == \
        (K, "forward", "", [5], True)
    assert _hooks(net) == 0  # detached
    rep = replay(info.value.bundle_path)
    assert rep["reproduced"] is True and rep["cause"] == "invalid"
    assert (rep["origin"]["module"], rep["origin"]["op"]) == ("act", "aten.log")


def test_compiled_model_run_before_the_recorder_attached(tmp_path, caplog):
    """A compiled ``nn.Sequential`` whose wrapper ran before the recorder attached (a warm-up
    forward that triggers the compilation, or a second model after a first one trained
    without the recorder): dynamo keeps the code it compiled then, and does not guard on the
    hooks of torch's own modules, so the recorder's hooks never ran ("optimizer.step() ran
    with no forward of the recorded model ...") and step K's NaN record was caught late, as a
    backward event. Attaching drops that code: it is step K's input event, sample 5."""
    warm = torch.compile(R.make_mlp(), backend="eager")  # an earlier model, trained bare
    warm(R.batch(0)[0]).sum().backward()
    model = torch.compile(R.make_mlp(), backend="eager")
    model(R.batch(0)[0])  # its warm-up forward
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with caplog.at_level("WARNING", logger="nanreplay"), pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path):
            for step in range(K + 2):
                x, y = R.batch(step)
                if step == K:
                    x[5, 0] = float("nan")
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    said = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert not said, said
    ev = info.value.event
    assert (ev["step"], ev["phase"], ev["samples"]) == (K, "input", [5])
    assert _hooks(model) == 0  # detached
