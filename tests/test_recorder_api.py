"""The public surface: construction checks, attach/detach, the context manager, the error."""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import models as M
import pytest
import torch
from ci import NEEDS_PY311
from models import bundles, check_event
from torch import nn

import recorder
from recorder import BundleError, FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

# ---------------------------------------------------------------------------------------------
# construction: clear one-line errors, nothing attached


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    assert msg.startswith("FlightRecorder: "), msg
    return msg


def test_public_names():
    assert set(recorder.__all__) == {"FlightRecorder", "NonFiniteError", "BundleError"}
    assert issubclass(NonFiniteError, RuntimeError)
    assert issubclass(BundleError, ValueError)


def test_model_must_be_a_module(out_dir):
    with pytest.raises(TypeError) as info:
        FlightRecorder(lambda x: x, out_dir=out_dir)
    msg = _one_line(info)
    assert "model must be a torch.nn.Module, got function" in msg


def test_optimizer_must_be_an_optimizer(out_dir):
    with pytest.raises(TypeError) as info:
        FlightRecorder(M.mlp(), object(), out_dir=out_dir)
    assert "optimizer must be a torch.optim.Optimizer, got object" in _one_line(info)


def test_optimizer_params_not_in_the_model(out_dir):
    model, other = M.mlp(), nn.Linear(5, 7)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError) as info:
        FlightRecorder(model, opt, out_dir=out_dir)
    msg = _one_line(info)
    assert "2 optimizer parameter(s) are not parameters of the model" in msg
    assert "[7, 5]" in msg  # the stray shapes are named
    assert "build the optimizer from this model's parameters()" in msg


def test_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=blocker / "bundles")
    msg = _one_line(info)
    assert f"out_dir '{blocker / 'bundles'}' is not writable" in msg
    assert "pass a directory this process can write" in msg


def test_out_dir_created_and_left_clean(tmp_path):
    d = tmp_path / "new" / "bundles"
    FlightRecorder(M.mlp(), out_dir=d)
    assert d.is_dir() and list(d.iterdir()) == []  # the write probe is gone


@pytest.mark.parametrize("factory", ["mypkg.train", "mypkg.train:", ":make_model"])
def test_factory_malformed(out_dir, factory):
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory=factory)
    msg = _one_line(info)
    assert f"factory {factory!r} is not of the form 'module:function'" in msg


@pytest.mark.parametrize("factory, error", [
    ("no_such_package_nanreplay:make_model", "ModuleNotFoundError"),
    ("models:no_such_builder", "AttributeError"),
])
def test_factory_not_importable(out_dir, factory, error):
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory=factory)
    msg = _one_line(info)
    assert f"factory {factory!r} cannot be imported ({error}" in msg


@pytest.mark.parametrize("factory, meant", [
    ("models:mlpp", "models:mlp"),  # a typo
    ("models:mlp()", "models:mlp"),  # the call written out
    ("models:Logof.forward", "models:LogOf.forward"),  # the case of a class's name
    ("models:zzzz_qqqq", None),  # nothing close: no guess
])
def test_a_misspelt_factory_names_the_closest_function(out_dir, factory, meant):
    """Python's own "Did you mean" comes only with a traceback; the one line says it."""
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory=factory)
    msg = _one_line(info)
    assert ("closest name" in msg) is (meant is not None), msg
    if meant is not None:
        assert f"; pass {meant!r} (the closest name it has), or 'module:function'" in msg, msg


def test_factory_not_callable(out_dir):
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory="models:D_IN")
    assert "factory 'models:D_IN' is not callable" in _one_line(info)


def test_a_factory_given_as_the_function_is_stored_as_its_import_path(out_dir):
    """``factory=make_model`` (the function, as a user first writes it) is kept as
    ``"module:function"``; a partial's keywords join ``factory_kwargs`` (which win)."""
    import functools

    rec = FlightRecorder(M.mlp(), out_dir=out_dir, factory=M.mlp)
    assert (rec.factory, rec.factory_kwargs) == ("models:mlp", None)
    rec = FlightRecorder(M.mlp(), out_dir=out_dir, factory=functools.partial(M.mlp, hidden=6),
                         factory_kwargs={"d_out": 2, "hidden": 5})
    assert (rec.factory, rec.factory_kwargs) == ("models:mlp", {"hidden": 5, "d_out": 2})


@pytest.mark.parametrize("factory, why", [
    (lambda: M.mlp(), "(a lambda, at "),
    (functools.partial(M.mlp, 4), "(a partial with positional arguments"),
])
def test_a_factory_function_nanreplay_cannot_import_is_refused_in_one_line(out_dir, factory,
                                                                            why):
    with pytest.raises(ValueError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory=factory)
    msg = _one_line(info)
    assert "cannot be rebuilt by nanreplay " + why in msg and "module-level function" in msg


def test_a_factory_that_is_neither_a_path_nor_a_function_is_refused(out_dir):
    with pytest.raises(TypeError) as info:
        FlightRecorder(M.mlp(), out_dir=out_dir, factory=3)
    assert "factory must be 'module:function' or a module-level function" in _one_line(info)


def test_factory_dotted_attribute_accepted(out_dir):
    rec = FlightRecorder(M.mlp(), out_dir=out_dir, factory="models:TinyGPT.forward")
    assert rec.factory == "models:TinyGPT.forward"


SCRIPT = """
import torch
from torch import nn
from recorder import FlightRecorder

def make_model():
    return nn.Linear(4, 2)

{guard}
    print("training starts")
    model = make_model()
    with FlightRecorder(model, out_dir="bundles", factory="train_script:make_model"):
        model(torch.randn(2, 4))
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_factory_in_the_script_being_run_is_not_imported_again(tmp_path, guarded):
    """``python train_script.py`` with ``factory="train_script:make_model"``: checking the
    factory must not import the script under its own name, which would run the training a
    second time inside the recorder's constructor. A script whose training is not under the
    ``__main__`` guard is told that nanreplay's import of it would run it too."""
    guard = 'if __name__ == "__main__":' if guarded else "if True:"
    (tmp_path / "train_script.py").write_text(SCRIPT.format(guard=guard))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "train_script.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("training starts") == 1, res.stdout
    warned = "is not under `if __name__ == \"__main__\":`" in res.stderr
    assert warned is not guarded, res.stderr


LOSS_SCRIPT = """
import torch
from torch import nn
from recorder import FlightRecorder, NonFiniteError

def make_model():
    return nn.Linear(4, 2)

def {loss}(out, y):
    return torch.exp(out).mean() - out.gather(1, y[:, None]).mean()  # no max subtracted

{guard}
    print("training starts")
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with FlightRecorder(model, opt, loss_fn={loss}, out_dir="bundles",
                            factory="loss_script:make_model") as rec:
            for step in range(6):
                x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
                if step == 3:
                    x[5] *= 1e4
                opt.zero_grad()
                rec.loss_fn(model(x), y).backward()
                opt.step()
    except NonFiniteError as e:
        print("BUNDLE", e.bundle_path)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_loss_function_defined_in_the_script_being_run_is_replayed(tmp_path, guarded):
    """``loss_fn`` defined in the training script run as ``python loss_script.py``: with the
    training under the ``__main__`` guard, the bundle names it by the script's module name and
    nanreplay imports it, as it does the factory, and re-runs it (the op and cause); without
    the guard it is not imported (that would train again) and the note says why."""
    guard = 'if __name__ == "__main__":' if guarded else "if True:"
    (tmp_path / "loss_script.py").write_text(LOSS_SCRIPT.format(guard=guard, loss="exp_loss"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "loss_script.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.count("training starts") == 1, res.stderr
    bundle = res.stdout.split("BUNDLE ", 1)[1].split()[0]
    meta, _ = read_bundle(Path(tmp_path, bundle))
    loss = meta["loss"]
    assert loss["kind"] == "function" and loss["name"] == "__main__.exp_loss"
    if not guarded:
        assert "import" not in loss and loss["why"] == "script"
        return
    assert loss["import"] == "loss_script:exp_loss"
    rep = subprocess.run([sys.executable, "-m", "replay", bundle, "--json"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert "training starts" not in rep.stdout, rep.stdout  # the import ran no training
    report = json.loads(rep.stdout)
    o = report["origin"]
    assert (report["event"]["step"], o["phase"], o["op"], report["cause"]) == \
        (3, "loss", "aten.exp", "overflow"), report
    assert o["source"].endswith("loss_script.py:10") and o["samples"] == [5]


@pytest.mark.parametrize("kwargs, exc, phrase", [
    ({"on_event": "ignore"}, ValueError, "on_event must be 'raise' or 'warn', got 'ignore'"),
    ({"history": 0}, ValueError, "history must be a positive int, got 0"),
    ({"allow_inf": "*.mask"}, TypeError, "allow_inf must be a list of name patterns"),
    ({"allow_inf": [3]}, TypeError, "allow_inf must be a list of name patterns"),
    ({"scaler": object()}, TypeError, "scaler must be a torch.amp.GradScaler, got object"),
    ({"loss_fn": 3}, TypeError, "loss_fn must be callable, got int"),
    ({"stats": "all"}, ValueError, "stats must be 'minmax' or 'full', got 'all'"),
    ({"lr_scheduler": 3}, TypeError, "lr_scheduler must be a scheduler with a state_dict()"),
    ({"min_scale": "x"}, ValueError, "min_scale must be a finite number >= 0"),
    ({"min_scale": math.nan}, ValueError, "min_scale must be a finite number >= 0"),
    ({"start_step": -1}, ValueError, "start_step must be an int >= 0, got -1"),
    ({"start_step": 2.5}, ValueError, "start_step must be an int >= 0, got 2.5"),
    ({"max_skipped_steps": -3}, ValueError, "max_skipped_steps must be an int >= 0, got -3"),
    ({"max_micro_batches": 0}, ValueError, "max_micro_batches must be an int >= 1, got 0"),
])
def test_bad_arguments(out_dir, kwargs, exc, phrase):
    model = M.mlp()
    with pytest.raises(exc) as info:
        FlightRecorder(model, out_dir=out_dir, **kwargs)
    assert phrase in _one_line(info)
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_data_parallel_over_several_devices_is_refused(out_dir):
    """DataParallel replicates the model per device in threads every forward (its device_ids
    set by hand here: this machine has no GPU, where DataParallel keeps none and just calls the
    module, which is recorded as usual)."""
    model = M.mlp()
    dp = nn.DataParallel(model)
    assert dp.device_ids == [] or torch.cuda.device_count() > 1
    FlightRecorder(dp, out_dir=out_dir)  # no devices, or one: fine
    dp.device_ids = [0, 1]
    for wrapped in (dp, nn.Sequential(dp)):
        with pytest.raises(ValueError) as info:
            FlightRecorder(wrapped, out_dir=out_dir)
        assert "nn.DataParallel over 2 devices is not supported" in _one_line(info)
        assert "DistributedDataParallel" in _one_line(info)
    assert not model._forward_hooks


def test_construction_does_not_attach(out_dir):
    model = M.mlp()
    FlightRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1), out_dir=out_dir)
    assert all(not m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------------------------------
# attach / detach


def _hook_counts(model, opt, loss_fn):
    return {
        "forward": sum(len(m._forward_hooks) for m in model.modules()),
        "forward_pre": sum(len(m._forward_pre_hooks) for m in model.modules()),
        "loss": len(loss_fn._forward_hooks) + len(loss_fn._forward_pre_hooks),
        "grad": sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()),
        "opt": len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks),
    }


def _no_hooks_left(model, opt, loss_fn):
    for m in [*model.modules(), loss_fn]:
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._forward_hooks_with_kwargs and not m._forward_pre_hooks_with_kwargs
        assert not m._backward_hooks and not m._backward_pre_hooks
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks
        assert not p._backward_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_every_gradient_is_measured_small_ones_batched(out_dir, with_optimizer):
    layers = [nn.Linear(4, 4) for _ in range(10)] + [nn.Linear(4, 256), nn.Linear(256, 256)]
    model = nn.Sequential(*layers)  # 23 small parameters, one of 65536 elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = FlightRecorder(model, opt if with_optimizer else None, out_dir=out_dir).attach()
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    # With an optimizer, norms are read in its pre-hook; without one, backward hooks take
    # the large ones (the user's update and zero_grad come before the step closes).
    assert hooks == [0] * 24 if with_optimizer else [0] * 22 + [1, 0]
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 4)).square().mean().backward()
        if with_optimizer:
            opt.step()
        else:
            rec.end_step()
    assert rec.step == 2
    layout = rec.cycle.ring.layouts[-1].materialize()
    assert sorted(i for i, _ in layout.grads) == list(range(24))  # every gradient measured
    rec.detach()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_attach_is_idempotent_and_detach_removes_every_hook(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir)
    assert rec.attach() is rec
    counts = _hook_counts(model, opt, crit)
    rec.attach()
    assert _hook_counts(model, opt, crit) == counts
    # one post-hook per module (the loss's sees its targets too), a pre-hook on the root, an
    # optimizer pre-hook (closes the step) and post-hook (measures what the update wrote)
    assert counts == {"forward": 4, "forward_pre": 1, "loss": 1, "grad": 0, "opt": 2}
    M.train(model, opt, crit, 3)
    rec.detach()
    _no_hooks_left(model, opt, crit)
    rec.detach()  # twice is fine
    # detached: a NaN goes unnoticed, the step counter stands still
    x, y = M.batch(9)
    x[0, 0] = float("nan")
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.zero_grad()
    opt.step()
    assert rec.step == 3 and rec.event is None
    # and it can be attached again
    with rec:
        M.train(model, opt, crit, 1, make_batch=lambda s: M.batch(10 + s))
    assert rec.step == 4


def test_a_second_recorder_on_the_model_detaches_the_first(out_dir):
    """A notebook cell run again: ``rec = FlightRecorder(model, ...).attach()`` a second time
    left the first recorder, no longer reachable, attached beside the new one (two sets of
    hooks, two host reads a step, a bundle from each). The new one now detaches it, with a
    warning, and records alone; a recorder of another model is left alone."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir / "a").attach()
    counts = _hook_counts(model, opt, crit)
    other = M.mlp()
    elsewhere = FlightRecorder(other, out_dir=out_dir / "c").attach()
    with pytest.warns(UserWarning, match="^nanreplay: Sequential already had a FlightRecorder "
                      "attached .* it is detached now"):
        second = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir / "b").attach()
    assert _hook_counts(model, opt, crit) == counts  # (one recorder's hooks)
    with pytest.raises(NonFiniteError):
        M.train(model, opt, crit, 6, make_batch=_nan_at(3))
    assert (first.event, second.event["step"]) == (None, 3)
    assert bundles(out_dir / "a") == [] and len(bundles(out_dir / "b")) == 1
    _no_hooks_left(model, opt, crit)
    assert sum(len(m._forward_hooks) for m in other.modules()) > 0  # (still recorded)
    elsewhere.detach()


def test_a_raised_event_takes_the_recorders_hooks_off(out_dir):
    """A recorder attached without a ``with`` block (``rec = FlightRecorder(...).attach()``,
    as the README shows) that raised its event kept every hook: a loop that catches the
    NonFiniteError and trains on, or attaches a new recorder, paid the dead recorder's hooks
    on every module call from then on. A raised event now detaches it; what it found stays
    readable."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir).attach()
    with pytest.raises(NonFiniteError):
        M.train(model, opt, crit, 6, make_batch=_nan_at(3))
    _no_hooks_left(model, opt, crit)
    assert (rec.event["step"], rec.bundle_path.exists()) == (3, True)
    stopped_at = rec.step
    M.train(model, opt, crit, 2)  # the loop trains on, unrecorded
    assert rec.step == stopped_at


def _nan_at(k: int):
    def make(step):
        x, y = M.batch(step)
        if step == k:
            x[1, 0] = float("nan")
        return x, y

    return make


def _train_then_detach(out_dir, plain_loss: bool):
    model = M.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.functional.cross_entropy if plain_loss else nn.CrossEntropyLoss()
    with FlightRecorder(model, opt, loss_fn=loss_fn, out_dir=out_dir, guard_optimizer=True,
                        factory="models:mlp") as rec:
        M.train(model, opt, loss_fn, 3, rec=rec if plain_loss else None)
    return rec, model, opt


@pytest.mark.parametrize("plain_loss", [False, True])
def test_detach_keeps_no_reference(out_dir, plain_loss):
    rec, model, opt = _train_then_detach(out_dir, plain_loss)
    _no_hooks_left(model, opt, rec.loss_fn if plain_loss else nn.Module())
    wm, wo = weakref.ref(model), weakref.ref(opt)
    wp = [weakref.ref(p) for p in model.parameters()]
    del model, opt
    gc.collect()
    assert wm() is None and wo() is None
    assert all(w() is None for w in wp)
    assert rec.step == 3  # the recorder itself is still usable
    with pytest.raises(RuntimeError, match="the model no longer exists"):
        rec.attach()


def _event_then_drop(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = weakref.ref(model), weakref.ref(opt)
    try:
        with FlightRecorder(model, opt, loss_fn=lambda out, y: out.mean(), out_dir=out_dir) as rec:
            M.train(model, opt, None, 4, at=M.arm_at(2, model[1]), rec=rec)
    except NonFiniteError as e:
        event, path = e.event, e.bundle_path
    return rec, refs, event, path


def test_no_reference_after_an_event(out_dir):
    rec, (wm, wo), event, path = _event_then_drop(out_dir)
    gc.collect()
    assert wm() is None and wo() is None
    check_event(event, step=2, phase="forward", module="1")
    assert rec.event == event and rec.bundle_path == path and path.exists()


def test_context_manager_detaches_on_user_exception(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(KeyError, match="user bug"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
            M.train(model, opt, crit, 2)
            raise KeyError("user bug")
    _no_hooks_left(model, opt, crit)
    assert bundles(out_dir) == []


def _guarded_loop(model, opt, crit, steps, *, clip=False):
    """A loop with the user's own NaN guards: it raises on a non-finite loss, and with
    ``clip`` clips gradients with ``error_if_nonfinite=True``; either stops the loop before
    ``optimizer.step()`` closes the step."""
    for step in range(steps):
        x, y = M.batch(step)
        opt.zero_grad()
        loss = crit(model(x), y)
        if not clip and not torch.isfinite(loss):
            raise ValueError(f"loss is {loss.item()} at step {step}")
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        opt.step()


def _note(exc: BaseException) -> str | None:
    if not hasattr(exc, "add_note"):  # Python 3.10: the summary goes to the log instead
        pytest.skip(f"exception notes: {NEEDS_PY311}")
    notes = getattr(exc, "__notes__", [])
    assert len(notes) <= 1, notes
    return notes[0] if notes else None


def test_the_loops_own_nan_guard_still_gets_the_bundle(out_dir):
    """The loop raises on the NaN loss before optimizer.step() could close the step: leaving
    the ``with`` block checks the step (one read), writes the bundle, and the loop's own
    ValueError goes on with the recorder's summary as a note."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(), nn.Linear(M.HIDDEN, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="loss is nan at step 0") as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            model[1].armed = False
            _guarded_loop(model, opt, crit, 2)
            model[1].armed = True
            _guarded_loop(model, opt, crit, 1)  # its step 0 is the recorder's step 2
    check_event(rec.event, step=2, phase="forward", module="1")
    assert bundles(out_dir) == [rec.bundle_path]
    note = _note(info.value)
    assert note is not None and "at step 2, phase forward" in note
    assert str(rec.bundle_path) in note
    _no_hooks_left(model, opt, crit)


def test_clip_grad_norm_error_if_nonfinite_still_gets_the_bundle(out_dir):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` raises on the NaN gradient before the
    optimizer's pre-hook would have read the gradients: they are read when the ``with`` block
    sees the error, and the event names the parameters."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.SqrtOf(), nn.Linear(M.HIDDEN, 3))
    model[1].armed = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped") as info:
        with FlightRecorder(model, opt, loss_fn=nn.CrossEntropyLoss(), out_dir=out_dir) as rec:
            _guarded_loop(model, opt, nn.CrossEntropyLoss(), 3, clip=True)
    check_event(rec.event, step=0, phase="backward", params=["0.weight", "0.bias"])
    note = _note(info.value)
    assert note is not None and "at step 0, phase backward" in note


def test_an_exception_with_nothing_non_finite_writes_nothing(out_dir):
    """The check on the way out finds a finite step: no bundle, no note; a KeyboardInterrupt
    is not checked at all (the user wants out), NaN or not."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(), nn.Linear(M.HIDDEN, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="the user's own") as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            M.train(model, opt, crit, 2)
            model(M.batch(2)[0])  # a step open, all finite
            raise ValueError("the user's own")
    assert rec.event is None and bundles(out_dir) == []
    assert _note(info.value) is None
    model[1].armed = True
    with pytest.raises(KeyboardInterrupt):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            model(M.batch(0)[0])  # a NaN step open
            raise KeyboardInterrupt
    assert rec.event is None and bundles(out_dir) == []


@pytest.mark.parametrize("given", [None, "loss_fn", "record_loss"])
def test_a_nan_guard_on_a_loss_the_recorder_never_saw_says_so(out_dir, given):
    """The loop computes its loss itself and asserts it is finite (a bare ``assert``): the NaN
    was made outside the model, so the step the recorder saw is finite and no bundle is
    written. The AssertionError says so and what to pass; with ``loss_fn`` seen the note
    points past it; with ``record_loss`` the step's bundle is written instead."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AssertionError) as info:
        with FlightRecorder(model, opt, out_dir=out_dir,
                            loss_fn=crit if given == "loss_fn" else None) as rec:
            for step in range(3):
                x, y = M.batch(step)
                loss = crit(model(x), y)
                if step == 2:  # (the loop's own term: a log of a negative)
                    loss = loss + torch.log(-loss.detach())
                if given == "record_loss":
                    rec.record_loss(loss)
                assert not torch.isnan(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    note = _note(info.value)
    if given == "record_loss":
        check_event(rec.event, step=2, phase="loss")
        assert note is not None and str(rec.bundle_path) in note
        return
    assert rec.event is None and bundles(out_dir) == []
    assert note is not None and note.startswith(
        "nanreplay: every value the recorder saw in step 2 (the model's calls"), note
    assert ("pass loss_fn=" in note) is (given is None), note


def test_copies_of_a_recorded_model_get_inert_hooks(out_dir, tmp_path):
    """An EMA average built while recording (``AveragedModel`` deep-copies the model),
    ``copy.deepcopy`` and ``torch.save(model)``: each worked without the recorder (its locks and
    device buffers cannot be copied); the copies' hooks do nothing, so their forwards are not
    recorded as the model's, and the model's own recording goes on (the NaN is still caught
    at its step)."""
    import copy

    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(), nn.Linear(M.HIDDEN, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            ema = torch.optim.swa_utils.AveragedModel(
                model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
            twin = copy.deepcopy(model)
            path = tmp_path / "whole.pt"
            torch.save(model, path)
            loaded = torch.load(path, weights_only=False)
            for step in range(5):
                model[1].armed = step >= 3
                x, y = M.batch(step)
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                ema.update_parameters(model)
                for copy_ in (ema, twin, loaded):
                    copy_.eval()
                    with torch.no_grad():
                        copy_(x)  # not recorded: would be an evaluation forward if it were
                    assert rec.step == step + 1
    check_event(info.value.event, step=3, phase="forward", module="1")
    copies = [*ema.module.modules(), *twin.modules(), *loaded.modules()]
    hooks = [h for m in copies for h in (*m._forward_hooks.values(),
                                         *m._forward_pre_hooks.values())]
    assert hooks and all(h is recorder.hooks.inert for h in hooks)
    assert loaded[1].armed is False and torch.equal(loaded[0].weight, twin[0].weight)


def test_start_step_offsets_step_numbers(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=lambda o, y: o.mean(), out_dir=out_dir,
                            start_step=100) as rec:
            assert rec.step == 100
            M.train(model, opt, None, 4, at=M.arm_at(2, model[1]), rec=rec)
    check_event(info.value.event, step=102, phase="forward", module="1")
    assert info.value.bundle_path.name == "step00000102-rank0.nan"


def test_non_finite_error_fields(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=lambda o, y: o.mean(), out_dir=out_dir) as rec:
            M.train(model, opt, None, 4, at=M.arm_at(1, model[1]), rec=rec)
    err = info.value
    assert err.write_error is None and err.__cause__ is None
    assert (err.event["step"], err.event["phase"], err.event["module"]) == (1, "forward", "1")
    assert set(err.event) >= {"step", "reason", "phase", "module", "module_type", "call",
                              "micro_batch", "inputs_finite", "kind", "params", "tensor",
                              "samples", "detail"}
    msg = str(err)
    assert msg.startswith("nanreplay: non-finite value (NaN) at step 1, phase forward.")
    assert "First made by module '1' (models.LogOf, call 0, micro-batch 0)" in msg
    assert "whose inputs were finite" in msg
    assert f"nanreplay {err.bundle_path}" in msg


def test_end_step_closes_a_step_without_optimizer(out_dir):
    """A loop that updates by hand: ``end_step()`` closes each step (and checks it)."""
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf())
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, out_dir=out_dir) as rec:
            for step in range(5):
                model[1].armed = step == 2
                x, _ = M.batch(step)
                model.zero_grad()
                model(x).mean().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.01 * p.grad
                rec.end_step()
                assert rec.step == step + 1
    check_event(info.value.event, step=2, phase="forward", module="1")
    assert info.value.bundle_path.name == "step00000002-rank0.nan"


class _Parts(nn.Module):
    """A LightningModule-like model whose training step calls its parts, not its forward."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(M.D_IN, M.HIDDEN)
        self.dec = nn.Linear(M.HIDDEN, M.N_CLASSES)

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))

    def training_step(self, x):
        return self.dec(torch.relu(self.enc(x)))


@pytest.mark.parametrize("through_forward", [False, True])
def test_a_loop_that_never_calls_the_model_is_told_once(out_dir, caplog, through_forward):
    """Calling only submodules opens no step, so nothing would be checked: the first update
    says so, once, naming the first submodule that ran; a loop through forward (with a
    submodule called on its own between steps, for logging) is not warned."""
    model = _Parts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with caplog.at_level("WARNING", logger="nanreplay"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(3):
                x, y = M.batch(step)
                opt.zero_grad()
                out = model(x) if through_forward else model.training_step(x)
                crit(out, y).backward()
                opt.step()
                with torch.no_grad():
                    model.enc(x)  # a probe between steps
    said = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    if through_forward:
        assert said == [] and rec.step == 3
    else:
        assert rec.step == 0 and len(said) == 1, said
        assert "no forward of the recorded model" in said[0] and "'enc'" in said[0]


def test_a_recorder_built_before_the_folds_that_rebuild_the_model_says_it_saw_nothing(
        out_dir, caplog):
    """K-fold cross-validation written with the recorder built once, around the first model,
    and each fold building its model and optimizer again: the recorder's model never runs, so
    a fold's NaN raises nothing and no bundle is written. At the block's end it says so, with
    what to do; a block whose model ran says nothing."""
    def fold(k):
        model = M.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan if k == 1 else 0.0  # (fold 1 starts broken)
        M.train(model, opt, nn.CrossEntropyLoss(), 2)
        return model

    first = M.mlp()
    first_opt = torch.optim.SGD(first.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="nanreplay"):
        with FlightRecorder(first, first_opt, out_dir=out_dir) as rec:
            trained = [fold(k) for k in range(3)]
    said = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert not torch.isfinite(trained[1][0].weight).all() and not list(out_dir.glob("*.nan"))
    assert rec.step == 0 and said == [
        "nanreplay: the recorder saw no forward of its model (Sequential) and no step of its "
        "optimizer (SGD) while it was attached: nothing was recorded or checked. A model (and "
        "optimizer) built again after the recorder was, for a fold, a trial or a restart, is "
        "not the one it records: build the FlightRecorder around the model the loop trains, "
        "after building it"], said

    caplog.clear()
    with caplog.at_level("WARNING", logger="nanreplay"):
        with FlightRecorder(first, out_dir=out_dir) as rec:  # (no optimizer: its forwards)
            with torch.no_grad():
                first(M.batch(0)[0])
    assert not [r for r in caplog.records if r.name == "nanreplay"]


class _SelfForwarding(nn.Linear):
    """PyTorch's forward-forward example's layer: a Linear whose training calls
    ``self.forward(x)``, and whose forward calls a submodule."""

    def __init__(self):
        super().__init__(8, 8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(super().forward(x))


@pytest.mark.parametrize("direct", [True, False], ids=["model.forward(x)", "model.relu(x)"])
def test_a_loop_calling_forward_itself_is_told_to_call_the_model(out_dir, caplog, direct):
    """``model.forward(x)`` runs no hook: no step opens, and the warning named the submodule
    its forward called ('relu' ran on its own), advising to record another module. It now
    says the loop calls the forward itself, and to call the model; a loop that does call a
    part of the model on its own is still told so."""
    torch.manual_seed(0)
    m = _SelfForwarding()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="nanreplay"), \
            FlightRecorder(m, opt, out_dir=out_dir) as rec:
        for _ in range(2):
            opt.zero_grad()
            x = torch.randn(4, 8)
            (m.forward(x) if direct else m.relu(x) * m.weight.sum()).sum().backward()
            opt.step()
    said = [r.getMessage() for r in caplog.records if r.name == "nanreplay"]
    assert len(said) == 1 and rec.step == 0, said
    assert ("the loop calls its forward itself (model.forward(x))" in said[0]) is direct, said
    assert ("submodule 'relu' ran on its own" in said[0]) is not direct, said


@pytest.mark.parametrize("slip, meant", [("loss", "loss_fn"), ("criterion", "loss_fn"),
                                         ("outdir", "out_dir"), ("histroy", "history")])
def test_a_keyword_slip_names_the_argument_meant(slip, meant):
    model = M.mlp()
    with pytest.raises(TypeError) as info:
        FlightRecorder(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       **{slip: nn.CrossEntropyLoss()})
    assert str(info.value) == (f"FlightRecorder: unknown keyword argument(s) {slip}; did you "
                               f"mean {meant}=?")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
