"""The recorder never changes what training computes, and its memory does not grow."""

from __future__ import annotations

import random

import models as M
import numpy as np
import pytest
import torch
from models import identical
from torch import nn

from recorder import FlightRecorder, NonFiniteError
from recorder.bundle import read_bundle


def _train_run(out_dir, record: bool, options: dict, micro: int = 1):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = M.bn_mlp()  # dropout draws from the RNG, BatchNorm updates buffers
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()

    def loop():
        for step in range(5):
            opt.zero_grad()
            for mb in range(micro):
                x, y = M.batch(micro * step + mb)
                (crit(model(x), y) / micro).backward()
            opt.step()

    if record:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, **options) as rec:
            loop()
        assert rec.event is None and rec.step == 5
    else:
        loop()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optim = {f"{i}/{k}": v.clone() for i, st in enumerate(opt.state.values())
             for k, v in st.items()}
    return state, optim, torch.get_rng_state(), random.getstate(), np.random.get_state()


@pytest.mark.parametrize("options, micro", [
    ({}, 1),
    ({}, 3),
    ({"stats": "full", "guard_optimizer": True}, 1),
])
def test_training_is_bitwise_identical_with_and_without_the_recorder(out_dir, options, micro):
    plain = _train_run(out_dir, False, options, micro)
    recorded = _train_run(out_dir, True, options, micro)
    for a, b in zip(plain[:2], recorded[:2]):
        assert a.keys() == b.keys() and a
        for k in a:
            assert identical(a[k], b[k]), k
    assert torch.equal(plain[2], recorded[2])  # no torch RNG draw
    assert plain[3] == recorded[3]  # nor Python's
    np_a, np_b = plain[4], recorded[4]
    assert np_a[0] == np_b[0] and np.array_equal(np_a[1], np_b[1]) and np_a[2:] == np_b[2:]


def test_amp_training_is_bitwise_identical(out_dir):
    def run(record):
        torch.manual_seed(0)
        model = M.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        crit = nn.CrossEntropyLoss()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20)

        def loop():
            for step in range(6):
                x, y = M.batch(step)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = crit(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

        if record:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler):
                loop()
        else:
            loop()
        return model.state_dict(), scaler.get_scale(), torch.get_rng_state()

    a, b = run(False), run(True)
    assert all(identical(a[0][k], b[0][k]) for k in a[0])
    assert a[1] == b[1] and torch.equal(a[2], b[2])


# ---------------------------------------------------------------------------------------------
# memory


def test_ring_memory_is_allocated_once(out_dir):
    model, crit = M.bn_mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, history=8) as rec:
        assert rec.memory_bytes["ring"] == 0
        M.train(model, opt, crit, 1)
        first = rec.memory_bytes
        assert first["ring"] > 0
        assert first["statistics"] == 4 * 256 * 4  # the slots: four regions of 256 at first
        assert first["buffer_copies"] > 0  # BatchNorm's running statistics
        assert first["optimizer_guard"] == 0
        # the second step refits the slots to what the first used and a margin (five modules'
        # statistics, six gradient norms, the running statistics' min and max: 67 floats, not
        # 1,024), then nothing grows or shrinks
        M.train(model, opt, crit, 1, make_batch=lambda s: M.batch(s + 1))
        fitted = rec.memory_bytes
        assert fitted["statistics"] == 67 * 4
        assert fitted == {**first, "statistics": fitted["statistics"]}
        M.train(model, opt, crit, 12, make_batch=lambda s: M.batch(s + 2))
        assert rec.memory_bytes == fitted
        assert rec.step == 14


def test_ring_memory_scales_with_history(out_dir):
    sizes = []
    for history in (4, 8):
        model, crit = M.mlp(), nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, history=history) as rec:
            M.train(model, opt, crit, 2)
            sizes.append(rec.memory_bytes["ring"])
    assert sizes[1] == 2 * sizes[0] > 0


def test_ring_keeps_the_last_history_steps(out_dir):
    model = nn.Sequential(nn.Linear(M.D_IN, M.HIDDEN), M.LogOf(),
                          nn.Linear(M.HIDDEN, M.N_CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.CrossEntropyLoss()
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, history=4):
            M.train(model, opt, crit, 12, at=M.arm_at(9, model[1]))
    assert (info.value.event["step"], info.value.event["module"]) == (9, "1")
    meta, t = read_bundle(info.value.bundle_path)
    assert t["ring/steps"].tolist() == [6, 7, 8, 9]
    assert meta["ring"]["history"] == 4 and meta["ring"]["stored"] == 4
    assert t["ring/calls"].shape[0] == 4
    assert torch.isfinite(t["ring/loss"][:3]).all() and torch.isnan(t["ring/loss"][3])


def test_a_step_wider_than_the_ring_is_stored_truncated_and_checked_whole(out_dir):
    """The ring's width is set at the first step; a later step with many more entries (here
    40 micro-batches) is stored cut at that width, but a NaN past the cut is still an event.
    The slots grow to hold that step, and the ring with them: the next such step is stored
    whole."""
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step, n_micro in enumerate((1, 40, 40)):
                opt.zero_grad()
                for mb in range(n_micro):
                    x, y = M.batch(100 * step + mb)
                    if step == 2 and mb == n_micro - 1:
                        x[3, 0] = float("nan")
                    crit(model(x), y).backward()
                opt.step()
                if step == 1:  # stored cut, no false alarm from the cut
                    width = rec.cycle.ring.rows.shape[1]
                    assert rec.cycle.ring.truncated == 1 and rec.cycle.ring.layouts[-1].length == width
    assert info.value.bundle_path is not None and info.value.bundle_path.exists()
    assert info.value.event["step"] == 2 and info.value.event["micro_batch"] == 39
    assert info.value.event["phase"] == "input" and info.value.event["samples"] == [3]
    assert rec.cycle.ring.truncated == 1 and rec.cycle.ring.rows.shape[1] > width
    # the bundle's ring keeps what fit of the cut step, and marks nothing past the cut as NaN;
    # the step after it, in the grown slots and ring, is whole
    _, t = read_bundle(info.value.bundle_path)
    assert t["ring/steps"].tolist() == [0, 1, 2]
    kept = (t["ring/call_module"] >= 0).sum(dim=1).tolist()
    assert kept[0] == 4 and 0 < kept[1] < 40 * 4 and kept[2] == 40 * 4
    assert not (t["ring/calls"][1, :, 5] == 1).any() and torch.isfinite(t["ring/loss"][0])
