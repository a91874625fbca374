"""End to end: a loop that keeps training after a non-finite step. It catches
``NonFiniteError``, drops the bad batch's gradients and goes on; the raised event detached the
recorder, and ``rec.attach()`` in the handler re-arms it, so a second bad batch writes its own
bundle and raises again. Before, a re-attached recorder kept its hooks and host reads but
swallowed every later event: the second NaN batch's update was applied in silence."""

from __future__ import annotations

import hashlib

import keep_training_models as M
import pytest
import torch
from bundles import check_report, nanreplay_json
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle
from recorder.cycle import StepCycle

pytestmark = pytest.mark.usefixtures("in_tests_dir")
STEPS = 10


def hooks_on(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules()) \
        + sum(len(p._backward_hooks or {}) for p in model.parameters())


def bare() -> list[float]:
    """The same loop without a recorder: a batch whose loss is not finite is skipped."""
    model, losses = M.make_net(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    for s in range(STEPS):
        x, y = M.batch(s)
        opt.zero_grad()
        loss = crit(model(x), y)
        losses.append(loss.item())
        if torch.isfinite(loss):
            loss.backward()
            opt.step()
    return losses


def test_caught_events_each_write_a_bundle_after_reattach(out_dir, monkeypatch):
    reads = []
    read = StepCycle._read
    monkeypatch.setattr(StepCycle, "_read", lambda self, *a, **k: (
        reads.append(self.step), read(self, *a, **k))[1])
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="keep_training_models:make_net").attach()
    losses, caught, before, digest = [], [], {}, {}
    for s in range(STEPS):
        x, y = M.batch(s)
        before[s] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        try:
            loss = crit(model(x), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        except NonFiniteError as e:
            caught.append((s, e.event["step"], e.bundle_path))
            assert hooks_on(model) == 0  # (detached by the raise)
            digest[e.bundle_path] = hashlib.sha256(e.bundle_path.read_bytes()).hexdigest()
            opt.zero_grad()
            rec.attach()
    rec.detach()
    assert hooks_on(model) == 0
    assert list(map(repr, losses)) == list(map(repr, bare()))  # as the bare loop that skipped them
    assert [(s, k) for s, k, _ in caught] == [(k, k) for k in M.BLANK]
    paths = [p for _, _, p in caught]
    assert len(set(paths)) == len(M.BLANK) and sorted(out_dir.glob("*.nan")) == sorted(paths)
    for p in paths:  # the first bundle is left as it was written
        assert hashlib.sha256(p.read_bytes()).hexdigest() == digest[p]
    # one host read per step, after the events too (read as the step closes: numbered past it)
    assert reads == list(range(1, STEPS + 1)), reads
    for (s, _, p) in caught:
        _, tensors = read_bundle(p)
        for n, w in before[s].items():  # the weights as they were at that step
            assert torch.equal(tensors[f"weights/{n}"], w), (s, n)
        check_report(nanreplay_json(p), step=s, module="norm", op="aten.div",
                     samples=[M.BLANK[s]], cause="invalid")


def test_without_reattach_a_caught_event_stops_recording(out_dir):
    """The documented default: the raise detaches; the loop trains on unrecorded."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    caught = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for s in range(STEPS):
            x, y = M.batch(s)
            opt.zero_grad()
            try:
                crit(model(x), y).backward()
                opt.step()
            except NonFiniteError as e:
                caught.append(e.event["step"])
                opt.zero_grad()
    assert caught == [min(M.BLANK)] and rec.event["step"] == min(M.BLANK)
    assert len(list(out_dir.glob("*.nan"))) == 1 and hooks_on(model) == 0


def skip_loop(out_dir, end_step: bool):
    """Checks the loss before backward() and skips a batch whose loss is not finite (with
    ``rec.end_step()`` first, or not); re-attaches after each caught event."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                         factory="keep_training_models:make_net").attach()
    losses, caught = [], []
    for s in range(STEPS):
        x, y = M.batch(s)
        opt.zero_grad()
        try:
            loss = crit(model(x), y)
            losses.append(loss.item())
            if not torch.isfinite(loss):
                if end_step:
                    rec.end_step()
                continue
            loss.backward()
            opt.step()
        except NonFiniteError as e:
            caught.append((s, e))
            opt.zero_grad()
            rec.attach()
    rec.detach()
    return losses, caught


def test_a_loss_checked_before_backward_is_its_own_step_with_end_step(out_dir):
    losses, caught = skip_loop(out_dir, end_step=True)
    assert list(map(repr, losses)) == list(map(repr, bare()))
    assert [(s, e.event["step"]) for s, e in caught] == [(k, k) for k in M.BLANK]
    for s, e in caught:
        assert "rec.end_step()" not in str(e)
        check_report(nanreplay_json(e.bundle_path), step=s, module="norm", op="aten.div",
                     samples=[M.BLANK[s]], cause="invalid")


def test_a_loss_skipped_before_backward_is_said_at_the_later_step(out_dir):
    """Without end_step() the skipped batch's step stays open: its event comes from the next
    batch's step(); the message says why and what to call (before: nothing said so)."""
    _, caught = skip_loop(out_dir, end_step=False)
    first = min(M.BLANK)
    s, e = caught[0]
    assert (s, e.event["step"], e.event["micro_batch"], e.event["samples"]) == \
        (first + 1, first, 0, [M.BLANK[first]])
    assert "Micro-batch 0's loss went through no backward" in str(e)
    assert "Call rec.end_step() before the `continue`" in str(e)


def test_gradient_accumulation_is_no_skipped_batch(out_dir):
    """Two micro-batches per step, each with its backward: the bad one is not said skipped."""
    model = M.make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info, FlightRecorder(model, opt, loss_fn=crit,
                                                               out_dir=out_dir):
        for s in range(STEPS // 2):
            opt.zero_grad()
            for k in (2 * s + 1, 2 * s + 2):  # (the bad batch is its step's first)
                x, y = M.batch(k)
                crit(model(x), y).backward()
            opt.step()
    first = min(M.BLANK)
    ev = info.value.event
    assert (ev["step"], ev["micro_batch"], ev["samples"]) == ((first - 1) // 2, 0,
                                                              [M.BLANK[first]])
    assert "rec.end_step()" not in str(info.value)
