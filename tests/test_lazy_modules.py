"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ``nn.LazyBatchNorm2d``): parameters with
no shape until the first forward infers them. A recorder built around such a model before that
forward raised ``ValueError: Attempted to use an uninitialized parameter`` from its attach (a
traceback out of ``with FlightRecorder(...)``), and a bundle of one replayed as "replay failed
(RuntimeError: Can't access the shape of an uninitialized parameter ...)". Now the attach waits
for a forward that begins with every parameter initialized (``recorder/lazy_init.py``), counting
the updates before it as steps, and the replay gives the factory's lazy modules the bundle's
shapes and inferred sizes (``replay.weights``)."""

from __future__ import annotations

import logging

import lazy_models as L
import pytest
import torch
from bundles import nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError

pytestmark = pytest.mark.usefixtures("in_tests_dir")


def _loop(model, opt, crit, steps: int, bad_step: int | None = None, data=None) -> list[float]:
    losses = []
    for _, (x, y) in zip(range(steps), data or L.batches(steps, bad_step=bad_step)):
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _hooks(model: nn.Module, opt) -> list[int]:
    """How many forward hooks each module holds (a lazy one holds its own pre-hook until its
    first forward), and the optimizer's step hooks."""
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] + [
        len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)]


def test_a_lazy_model_recorded_from_before_its_first_forward_names_the_op(out_dir, caplog):
    """The log of a record's total intensity, negative in record 5 of step 3's batch (a
    flipped sign): NaN made by ``aten.log`` in module ``total`` for sample 5 at step 3, an
    invalid operation (log of a negative number). Step 0's forward initialized the lazy
    modules, so the recorder attached at step 1's forward and counted step 0's update: its
    step numbers are the loop's."""
    model = L.make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with caplog.at_level(logging.INFO, logger="nanreplay"):
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                                factory="lazy_models:make_cnn"):
                _loop(model, opt, crit, steps=6, bad_step=3)
    said = [r.getMessage() for r in caplog.records if "lazy modules" in r.getMessage()]
    assert len(said) == 1 and "'features.0.weight'" in said[0], said
    err = info.value
    assert (err.event["step"], err.event["phase"]) == (3, "forward"), err.event
    rep = nanreplay_json(err.bundle_path, code=0)
    o = rep["origin"]
    assert rep["reproduced"] is True, rep
    assert (o["module"], o["op"], o["samples"], rep["cause"]) == (
        "total", "aten.log", [5], "invalid"), (o, rep["cause"])
    # the factory's lazy modules got the run's inferred sizes: no "built otherwise" note
    assert not [p for p in rep["problems"] if "differed" in p], rep["problems"]


def test_a_healthy_lazy_run_trains_as_without_the_recorder_and_leaves_no_hook(out_dir):
    def run(recorded: bool) -> tuple[list[float], list[int]]:
        model = L.make_cnn()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        crit = nn.CrossEntropyLoss()
        if not recorded:
            return _loop(model, opt, crit, steps=5), _hooks(model, opt)
        rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir).attach()
        assert not model.features[0]._forward_hooks  # (no shapes yet: nothing hooked)
        data = L.batches(5)
        losses = _loop(model, opt, crit, 1, data=data)  # (its forward initialized them)
        assert not model.features[0]._forward_hooks
        losses += _loop(model, opt, crit, 1, data=data)  # (attached as its forward began)
        assert model.features[0]._forward_hooks and rec.step == 2  # (step 0 counted)
        losses += _loop(model, opt, crit, 3, data=data)
        rec.detach()
        assert rec.event is None and not list(out_dir.glob("*.nan"))
        return losses, _hooks(model, opt)

    assert run(recorded=True) == run(recorded=False)


def test_a_dry_run_under_no_grad_initializes_and_the_steps_count_from_training(out_dir):
    """PyTorch's advice for lazy modules: a dry run on a dummy batch before training. With
    the recorder attached before it, no update ran meanwhile, so step 2 is the loop's
    third update."""
    model = L.make_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="lazy_models:make_cnn"):
            with torch.no_grad():
                model(torch.ones(1, 2, 8, 8))
            _loop(model, opt, crit, steps=4, bad_step=2)
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "forward")


def test_a_lazy_nn_sequential_replays_without_a_factory(out_dir):
    """torch.nn's own lazy modules become ``nn.Linear`` at their first forward, so the
    bundle describes plain modules and the replay rebuilds them: features left unscaled in
    record 4 of step 2 (x 1e30) are finite out of the first layer, their squares in the
    LayerNorm are not (overflow, sample 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(32), nn.LayerNorm(32), nn.ReLU(), nn.LazyLinear(3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            for step in range(4):
                x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
                if step == 2:
                    x[4] *= 1e30
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
    assert (info.value.event["step"], info.value.event["phase"]) == (2, "forward")
    rep = nanreplay_json(info.value.bundle_path, code=0)
    o = rep["origin"]
    assert (rep["reproduced"], o["module"], o["op"], o["samples"], rep["cause"]) == (
        True, "1", "aten.native_layer_norm", [4], "overflow"), (o, rep["cause"])


def test_a_recorder_detached_before_any_forward_leaves_no_hook(out_dir):
    model = L.make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bare = _hooks(model, opt)
    with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir):
        assert model._forward_pre_hooks  # (waiting for the first forward)
    assert _hooks(model, opt) == bare


def test_a_closure_loop_counts_the_step_whose_closure_initialized_them(out_dir):
    """``optimizer.step(closure)`` (Lightning's automatic optimization): the forward runs
    inside the step, after its pre-hooks. Step 1's forward, the first with shapes, began after
    step 1's pre-hooks ran without the recorder's, so step 1 is counted, not recorded, and
    recording starts at step 2: the plant at step 3 is step 3's event (it was step 2's, the
    closure's step merged into the next)."""
    model = L.make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    losses = []
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory="lazy_models:make_cnn") as rec:
            for step, (x, y) in enumerate(L.batches(6, bad_step=3)):
                def closure(x=x, y=y):
                    opt.zero_grad()
                    loss = crit(model(x), y)
                    loss.backward()
                    return loss

                losses.append(opt.step(closure).item())
                assert rec.step == step + 1
    assert (info.value.event["step"], info.value.event["phase"]) == (3, "forward")
    assert len(losses) == 3
