"""End to end: training loops that cut a step short and go on, the way long runs are written.
An out-of-memory skip (raised in the forward, the loss or a backward hook; the loop drops the
batch), a model refusing a malformed batch with ``ValueError`` (the loop logs and skips it), a
Ctrl-C in the forward, the backward or ``step()``, a SIGTERM handler's checkpoint-and-break
resumed by a new recorder with ``start_step``, and an early stop between ``backward()`` and
``step()``. A handled exception is no event and writes no bundle (the refused batch's NaN
features were, at the next ``step()``); a NaN planted later is found at its step, module and
samples; training is bit-identical with and without the recorder."""

from __future__ import annotations

import contextlib
import logging
import signal

import handled_exception_models as M
import pytest
import torch
import torch.nn as nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from replay import replay

pytestmark = pytest.mark.usefixtures("in_tests_dir")
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"
crit = nn.CrossEntropyLoss()


def recorder(model, opt, out_dir, factory="handled_exception_models:make_net", **kw):
    return FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, factory=factory, **kw)


def oom_loop(out_dir, data, ooms: dict[int, str], recorded: bool = True, make=M.make_net):
    """The OOM-skip pattern: ``ooms`` maps a batch to where it runs out of memory."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, skipped = [], []
    with recorder(model, opt, out_dir, f"handled_exception_models:{make.__name__}") \
            if recorded else contextlib.nullcontext():
        for i, (x, y) in enumerate(data):
            where = ooms.get(i)
            if where == "forward":
                M.RAISE["body"] = RuntimeError(OOM)
            try:
                out = model(x)
                if where == "loss":
                    raise RuntimeError(OOM)
                loss = crit(out, y)
                if where == "backward":
                    out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError(OOM)))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                skipped.append(i)
            except ValueError:  # a malformed batch: logged and skipped
                skipped.append(i)
            opt.zero_grad(set_to_none=True)
    return losses, model, skipped


def check_event(info, data, planted: int, skipped: list[int], row: int = 4):
    """The event of the constant ``row`` planted in batch ``planted``: at the step counting the
    updates before it, in ``norm``, that row; its bundle's micro-batch is that batch, and the
    replay names the 0/0."""
    ev = info.value.event
    step = sum(1 for i in range(planted) if i not in skipped)
    assert (ev["step"], ev["phase"], ev["module"], ev["samples"]) == (step, "forward", "norm",
                                                                      [row])
    _, tensors = read_bundle(info.value.bundle_path)
    assert torch.equal(tensors[f"batch/{ev['micro_batch']}/0"], data[planted][0])
    report = replay(info.value.bundle_path)
    o = report["origin"]
    assert (o["op"], o["module"], o["samples"], report["cause"]) == ("aten.div", "norm", [row],
                                                                     "invalid")


def test_out_of_memory_skips_are_no_events_and_a_later_nan_keeps_its_step(out_dir, caplog):
    ooms = {1: "forward", 3: "loss", 4: "backward"}
    data = M.batches(7)
    bare, bare_model, skipped = oom_loop(out_dir / "bare", data, ooms, recorded=False)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        losses, model, _ = oom_loop(out_dir / "rec", data, ooms)
    assert skipped == [1, 3, 4] and losses == bare and not caplog.records
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare_model.parameters()))
    assert not list(out_dir.rglob("*.nan"))
    for planted in (5, 2):  # a step after the skips; the batch right after a forward's skip
        data = M.batches(7, blank=planted)
        with pytest.raises(NonFiniteError) as info:
            oom_loop(out_dir / f"nan{planted}", data, ooms)
        check_event(info, data, planted, skipped)


def test_a_malformed_batch_the_model_refuses_is_skipped_without_an_event(out_dir, caplog):
    # (was: NonFiniteError at the next batch's step(), "non-finite value (NaN/Inf) at step 1")
    data = M.batches(6, malformed=1)
    bare, bare_model, skipped = oom_loop(out_dir / "bare", data, {}, False, M.make_checked)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        losses, model, _ = oom_loop(out_dir / "rec", data, {}, make=M.make_checked)
    assert skipped == [1] and losses == bare and not caplog.records
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare_model.parameters()))
    assert not list(out_dir.rglob("*.nan"))
    data = M.batches(6, blank=2, malformed=1)  # in the step the refused batch began
    with pytest.raises(NonFiniteError) as info:
        oom_loop(out_dir / "nan", data, {}, make=M.make_checked)
    check_event(info, data, 2, skipped)


def hooks_on(model, opt) -> int:
    """Every hook on the model's modules and parameters and on the optimizer."""
    n = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for m in model.modules():
        n += sum(len(getattr(m, d)) for d in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
    for p in model.parameters():
        n += len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
    return n


def ctrl_c(where: str, model, opt) -> None:
    """Arm a KeyboardInterrupt in the next forward, backward (a tensor hook) or ``step()`` (a
    step pre-hook registered after the recorder's: between its close and the update)."""
    def raise_ki(*_):
        raise KeyboardInterrupt

    if where == "forward":
        M.RAISE["body"] = KeyboardInterrupt()
    elif where == "backward":
        model.body.fc1.weight.register_hook(raise_ki)
    else:
        opt.register_step_pre_hook(raise_ki)


def interrupted(out_dir, where: str, recorded: bool, data):
    """Ctrl-C at batch 2 inside the ``with`` block; then, the user's armed hooks gone, two
    batches without the recorder and three under a new one (a notebook cell run again)."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, losses = hooks_on(model, opt), []
    with pytest.raises(KeyboardInterrupt):
        with recorder(model, opt, out_dir) if recorded else contextlib.nullcontext():
            for i, (x, y) in enumerate(data[:4]):
                opt.zero_grad()
                if i == 2:
                    ctrl_c(where, model, opt)
                crit(model(x), y).backward()
                opt.step()
    M.RAISE.clear()
    opt._optimizer_step_pre_hooks.clear()  # (the user's own armed hooks, not the recorder's)
    model.body.fc1.weight._backward_hooks = None
    left = hooks_on(model, opt) - before
    for k, (x, y) in enumerate(data[4:]):
        with recorder(model, opt, out_dir / "again") if k >= 2 else contextlib.nullcontext():
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return left, losses, model


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_ctrl_c_detaches_cleanly_and_a_new_recorder_works(out_dir, where, caplog, capsys):
    data = M.batches(9)
    _, bare, bare_model = interrupted(out_dir / "bare", where, False, data)
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        left, losses, model = interrupted(out_dir / "rec", where, True, data)
    assert left == 0 and losses == bare and not caplog.records
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare_model.parameters()))
    assert not list(out_dir.rglob("*.nan")) and not capsys.readouterr().err


def preemptible(out_dir, data, ckpt, resume: bool = False, preempt_at: int | None = None):
    """A SIGTERM handler sets a flag; the loop saves a checkpoint after that step's update and
    breaks out of the ``with`` block; a new run loads it under a recorder built with
    ``start_step`` = the steps done."""
    stop = []
    old = signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        model = M.make_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        start = 0
        if resume:
            state = torch.load(ckpt)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"]
        losses = []
        with recorder(model, opt, out_dir, start_step=start) as rec:
            for i in range(start, len(data)):
                x, y = data[i]
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                if i == preempt_at:
                    signal.raise_signal(signal.SIGTERM)
                opt.step()
                losses.append(loss.item())
                if stop:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "step": i + 1}, ckpt)
                    break
        return losses, rec.step
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_preempted_run_resumes_with_its_step_numbers(out_dir):
    data = M.batches(8)
    whole, _ = preemptible(out_dir / "whole", data, out_dir / "unused.pt")
    first, at = preemptible(out_dir / "first", data, out_dir / "ck.pt", preempt_at=3)
    rest, end = preemptible(out_dir / "rest", data, out_dir / "ck.pt", resume=True)
    assert (at, end) == (4, 8) and first + rest == whole
    assert not list(out_dir.rglob("*.nan"))
    data = M.batches(8, blank=6)
    with pytest.raises(NonFiniteError) as info:
        preemptible(out_dir / "nan", data, out_dir / "ck.pt", resume=True)
    check_event(info, data, 6, [])


def early_stopped(out_dir, data, recorded: bool = True, stop_at: int = 3):
    """An early-stopping check between ``backward()`` and ``step()`` breaks out."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with recorder(model, opt, out_dir) if recorded else contextlib.nullcontext():
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            losses.append(loss.item())
            if i == stop_at:
                break
            opt.step()
    return losses, model


def test_a_break_before_step_checks_the_last_step(out_dir):
    data = M.batches(6)
    bare, bare_model = early_stopped(out_dir / "bare", data, recorded=False)
    losses, model = early_stopped(out_dir / "rec", data)
    assert losses == bare and not list(out_dir.rglob("*.nan"))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), bare_model.parameters()))
    data = M.batches(6, blank=3)  # the batch the loop broke out at
    with pytest.raises(NonFiniteError) as info:
        early_stopped(out_dir / "nan", data)
    check_event(info, data, 3, [])
