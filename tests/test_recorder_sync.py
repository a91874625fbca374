"""At most one host-device sync per optimizer step in default mode.

Every Python-level way of reading a tensor's value on the host (``item``, ``bool``, ``tolist``,
``float``, ``int``) is replaced on ``torch.Tensor`` by a counting wrapper that also notes the
file of its caller. The optimizer is Adam with ``fused=True``: the default Adam reads its CPU
step counter with ``.item()`` on every update, which would blur the count.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import models as M
import pytest
import torch
from torch import nn

import recorder.flight
from recorder import FlightRecorder

SYNC_METHODS = ("item", "__bool__", "tolist", "__float__", "__int__")
_MISSING = object()
FLIGHT = str(Path(recorder.flight.__file__).resolve())


@contextmanager
def count_host_reads():
    """Yields a list that gets one ``(method, caller file)`` per host read of a tensor."""
    calls: list[tuple[str, str]] = []
    saved = {n: torch.Tensor.__dict__.get(n, _MISSING) for n in SYNC_METHODS}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            calls.append((name, str(Path(sys._getframe(1).f_code.co_filename).resolve())))
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        yield calls
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


def _loop(model, opt, crit, steps, *, micro=1, make_batch=M.batch):
    """Yields after each optimizer step (so the caller can read the counter)."""
    for step in range(steps):
        opt.zero_grad()
        for mb in range(micro):
            x, y = make_batch(micro * step + mb)
            loss = crit(model(x), y) / micro
            loss.backward()
        opt.step()
        yield step


def _per_step(model, opt, crit, steps, **kw):
    per_step = []
    with count_host_reads() as calls:
        seen = 0
        for _ in _loop(model, opt, crit, steps, **kw):
            per_step.append(calls[seen:])
            seen = len(calls)
    return per_step


def test_counter_sees_host_reads():
    t = torch.tensor([1.5, 2.0])
    with count_host_reads() as calls:
        t.tolist()
        float(t[0])
        int(t[1])
        bool(t[0] > 1)
        t[0].item()
    assert [n for n, _ in calls] == ["tolist", "__float__", "__int__", "__bool__", "item"]
    assert all(f == str(Path(__file__).resolve()) for _, f in calls)
    assert "item" not in torch.Tensor.__dict__  # restored


def test_bare_training_has_no_host_read():
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    per_step = _per_step(model, opt, crit, 5)
    assert per_step == [[]] * 5


@pytest.mark.parametrize("options", [
    {},
    {"stats": "full"},
    {"allow_inf": ["1"]},
    {"history": 2},
])
def test_one_host_read_per_step(out_dir, options):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    steps = 6
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **options) as rec:
        per_step = _per_step(model, opt, crit, steps)
    assert [len(c) for c in per_step] == [1] * steps, per_step
    assert all(f == FLIGHT for c in per_step for _, f in c)  # none in the loop's own code
    assert rec.event is None and rec.step == steps


def test_one_host_read_per_step_with_batchnorm_and_dropout(out_dir):
    model, crit = M.bn_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        per_step = _per_step(model, opt, crit, 4)
    assert [len(c) for c in per_step] == [1] * 4, per_step


def test_one_host_read_per_step_with_accumulation(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        per_step = _per_step(model, opt, crit, 4, micro=4)
    assert [len(c) for c in per_step] == [1] * 4, per_step
    assert all(f == FLIGHT for c in per_step for _, f in c)


def test_one_host_read_per_step_with_a_dict_batch_and_a_plain_loss(out_dir):
    model = M.DictNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)

    def make(step):
        x, y = M.batch(step)
        return {"image": x, "extra": M.batch(step + 50)[0]}, y

    with FlightRecorder(model, opt, loss_fn=nn.functional.cross_entropy,
                        out_dir=out_dir) as rec:
        per_step = _per_step(model, opt, rec.loss_fn, 4, make_batch=make)
    assert [len(c) for c in per_step] == [1] * 4, per_step


def test_one_host_read_per_step_with_a_loss_given_to_record_loss(out_dir):
    model = M.mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, out_dir=out_dir) as rec:
        def crit(out, y):
            loss = nn.functional.cross_entropy(out, y)
            rec.record_loss(loss)
            return loss

        per_step = _per_step(model, opt, crit, 4)
    assert [len(c) for c in per_step] == [1] * 4, per_step
    assert rec.event is None


def test_evaluation_forwards_read_once_each_and_steps_stay_at_one(out_dir):
    """A validation loop between steps: one read when each evaluation forward returns (it is
    checked apart, see the guide), one more when its loss is computed, and still exactly one
    per training step."""
    model, crit = M.bn_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    reads = []
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        with count_host_reads() as calls:
            for _ in _loop(model, opt, crit, 3):
                reads.append(("step", len(calls)))
                model.eval()
                with torch.no_grad():
                    for i in range(4):
                        x, y = M.batch(50 + i)
                        out = model(x)
                        reads.append(("eval", len(calls)))
                        if i % 2 == 0:
                            crit(out, y)
                            reads.append(("loss", len(calls)))
                model.train()
    counts = [(kind, n - prev) for (kind, n), (_, prev) in zip(reads, [("", 0)] + reads)]
    validation = [("eval", 1), ("loss", 1), ("eval", 1)] * 2
    assert counts == ([("step", 1)] + validation) * 3
    assert all(f == FLIGHT for _, f in calls)
    assert rec.step == 3


def test_guard_optimizer_costs_a_second_read(out_dir):
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, guard_optimizer=True):
        per_step = _per_step(model, opt, crit, 4)
    assert [len(c) for c in per_step] == [2] * 4, per_step
