"""Hooks firing from several threads: one event, exactly one bundle."""

from __future__ import annotations

import logging
import threading

import models as M
import pytest
import torch
from models import bundles, check_event
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle

K = 3


def test_branches_in_a_thread_pool_both_nan(out_dir):
    """The model's forward runs two branches in worker threads; both make NaN at step K."""
    model = M.TwoBranchThreaded()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    try:
        with pytest.raises(NonFiniteError) as info:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
                M.train(model, opt, crit, 6, at=M.arm_at(K, model.left[1], model.right[1]))
    finally:
        model.pool.shutdown()
    err = info.value
    assert bundles(out_dir) == [err.bundle_path]
    check_event(err.event, step=K, phase="forward", call=0, micro_batch=0, inputs_finite=True,
                kind="nan", module_type="models.LogOf")
    assert err.event["module"] in ("left.1", "right.1")
    meta, _ = read_bundle(err.bundle_path)
    names = [m["name"] for m in meta["modules"]]
    # every module call of the step was recorded, whichever thread ran it (but those of the
    # plain Sequentials, whose outputs are their last modules')
    assert set(meta["passthrough_modules"]) == {"left", "right"}
    assert sorted(names[i] for i, _ in meta["call_order"]) == \
        sorted(set(names) - {"left", "right"})


def test_branches_in_a_thread_pool_train_cleanly(out_dir):
    model = M.TwoBranchThreaded()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            M.train(model, opt, crit, 5)
    finally:
        model.pool.shutdown()
    assert rec.event is None and rec.step == 5 and bundles(out_dir) == []


def test_two_threads_forward_backward_a_shared_model_warn(out_dir, caplog):
    """Two threads run forward + backward at the same time (a barrier lines them up), the main
    thread steps the optimizer; at step K both threads' batches hold a NaN."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    steps, n_threads = 6, 2
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(step: int, t: int):
        try:
            x, y = M.batch(10 * step + t)
            if step == K:
                x[4, 0] = float("nan")
            barrier.wait(timeout=30)
            loss = crit(model(x), y) / n_threads
            loss.backward()
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
            barrier.abort()

    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event="warn") as rec:
            for step in range(steps):
                opt.zero_grad()
                threads = [threading.Thread(target=worker, args=(step, t))
                           for t in range(n_threads)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                opt.step()
    assert errors == []
    assert rec.step == steps
    assert len(bundles(out_dir)) == 1 and rec.bundle_path == bundles(out_dir)[0]
    check_event(rec.event, step=K, phase="input", module="", tensor="batch", samples=[4],
                kind="nan")
    assert rec.event["micro_batch"] in (0, 1)
    warnings = [r for r in caplog.records if r.name == "nanreplay"]
    assert len(warnings) == 1 and str(rec.bundle_path) in warnings[0].getMessage()
    meta, t = read_bundle(rec.bundle_path)
    assert len(meta["micro_batches"]) == n_threads  # one per thread's forward
    for mb in range(n_threads):
        assert torch.isnan(t[f"batch/{mb}/0"][4, 0])


def test_two_threads_race_to_step_the_optimizer(out_dir):
    """Both threads run forward + backward, then both call optimizer.step() at once: their
    pre-hooks race to close the same step. A NaN at step K in both: one event, one bundle."""
    model = M.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    crit = nn.CrossEntropyLoss()
    barrier = threading.Barrier(2)
    raised: list[NonFiniteError] = []
    errors: list[BaseException] = []

    def worker(t: int):
        try:
            for step in range(5):
                x, y = M.batch(10 * step + t)
                if step == K:
                    x[1, 1] = float("nan")
                barrier.wait(timeout=30)
                crit(model(x), y).backward()
                barrier.wait(timeout=30)  # no backward in flight while the weights change
                try:
                    opt.step()
                except NonFiniteError as e:
                    raised.append(e)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, on_event="warn") as rec:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert errors == [] and raised == []  # warn mode: nothing raised
    assert len(bundles(out_dir)) == 1
    assert rec.step == 5  # one step per iteration: the second pre-hook finds it closed
    check_event(rec.event, step=K, phase="input", tensor="batch", samples=[1], kind="nan")


def test_a_slot_taken_after_the_row_was_gathered_is_left_out():
    """A hook of another thread (the second optimizer.step() of the race above reading its
    gradients into the step being closed) may take a slot after the row was gathered: that slot
    holds no value of this step, so the layout leaves out what refers to it, and the bundle's
    tables are written whatever a row holds."""
    from recorder.ring import RingBuffer, StepLayout
    from recorder.slots import GRAD, LOOSE, STRICT

    # a row gathered region by region: 1 update, 2 STRICT entries, 2 GRAD, no NAN_ONLY,
    # 1 LOOSE (a stale -3.0)
    row = [9.0, 1.0, 2.0, 4.0, 16.0, -3.0]
    first = (0, 0, 0, (((STRICT, 0), (STRICT, 1)),), None, (((LOOSE, 0), (LOOSE, 0), False),))
    late_call = (1, 0, 1, (((STRICT, 0), (LOOSE, 1)),), None, ())  # LOOSE 1: past the row
    grads = [(0, (GRAD, 0)), (1, (GRAD, 1)), (2, (GRAD, 2))]  # GRAD 2: taken after the gather
    lay = StepLayout(step=5, lrs=[0.1], length=len(row))
    lay.raw = ([first, late_call], [], grads, [], (1, (0, 2, 4, 4), (2, 4, 4, 5)),
               [(0, (STRICT, 0))], [])
    lay.materialize()
    assert lay.grads == [(0, 3), (1, 4)]
    assert [c[0] for c in lay.calls] == [0] and lay.calls[0][5] == ((5, 5, False),)
    assert lay.updates == [(0, 0)]
    ring = RingBuffer(4)
    ring.reserve(len(row), torch.device("cpu")).copy_(torch.tensor(row))
    ring.commit(lay)
    lay.grads.append((2, 5))  # a "squared norm" that is negative: NaN in the table, no error
    _, tables = ring.export(n_params=3, n_groups=1)
    norms = tables["ring/grad_norms"][0].tolist()
    assert norms[:2] == [2.0, 4.0] and norms[2] != norms[2]


class _Gate(nn.Module):
    """Holds the thread named in ``wait_for`` inside the forward until ``go`` is set."""

    def __init__(self):
        super().__init__()
        self.go, self.inside, self.wait_for = threading.Event(), threading.Event(), None

    def forward(self, x):
        if threading.get_ident() == self.wait_for:
            self.inside.set()
            assert self.go.wait(timeout=30)
        return x * 1.0


def test_interleaved_forwards_of_two_threads_keep_their_own_micro_batches(out_dir):
    """Thread A's forward is held halfway while thread B runs a whole forward in the same step:
    A's later calls belong to A's micro-batch (0), not to the last one begun (B's). A NaN in
    A's batch is then the input of micro-batch 0 (with a micro-batch taken as "the last one
    begun", A's root call carried B's inputs and the event was a forward event of module
    '0' whose inputs were not finite)."""
    gate = _Gate()
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), gate, nn.ReLU(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    crit = nn.CrossEntropyLoss()
    xa, ya = M.batch(1)
    xb, yb = M.batch(2)
    xa[5, 2] = float("nan")
    losses = {}

    def a():
        gate.wait_for = threading.get_ident()
        losses["a"] = crit(model(xa), ya)

    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            th = threading.Thread(target=a)
            th.start()
            assert gate.inside.wait(timeout=30)
            losses["b"] = crit(model(xb), yb)  # thread B: this one
            gate.go.set()
            th.join()
            (losses["a"] + losses["b"]).backward()
            tape = rec.cycle.tape
            by_mb = {}
            for idx, mb, *_ in tape.calls:
                by_mb.setdefault(mb, []).append(idx)
            assert sorted(by_mb[0]) == sorted(by_mb[1]) == [0, 1, 2, 3, 4]
            assert [lm for lm, *_ in tape.loss] == [1, 0]  # B's loss first, then A's
            assert tape.micro_batches[0].args[0] is xa and tape.micro_batches[0].outputs.shape \
                == (len(xa), M.N_CLASSES)
            opt.step()
    check_event(info.value.event, step=0, phase="input", micro_batch=0, tensor="batch",
                samples=[5], kind="nan")
