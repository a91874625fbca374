"""At most one host-device sync per optimizer step in default mode.

What syncs is counted two ways, each entry noting the file of its caller:

- a ``TorchDispatchMode`` sees the aten ops that read a value on the host or sync inside C++:
  ``_local_scalar_dense`` (behind ``item``, ``bool``, ``float``, ``int``, ``__index__``),
  ``is_nonzero``, ``equal``, ``allclose``, ``nonzero``, boolean-mask indexing (``index`` /
  ``index_put_`` with a boolean index), ``masked_select``, ``unique``, and copies from a device
  to the host;
- counting wrappers on ``torch.Tensor`` see what passes no such op: ``tolist``, ``numpy``,
  ``cpu``, and a ``to`` that spells the host (``"cpu"``) or leaves a device for it.

The caller is the innermost frame outside torch's own package, so an op that torch runs for the
loop (the optimizer, GradScaler, DDP) is the loop's, and an op the recorder issues is the
recorder's. The optimizer is Adam with ``fused=True``: the default Adam reads its CPU step
counter with ``.item()`` on every update, which would blur the count. On CUDA the same
scenarios run with ``torch.cuda.set_sync_debug_mode("error")`` around every entry into the
recorder, where only the step's one read is let through.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import models as M
import pytest
import torch
import torch.distributed as dist
from ci import requires_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import recorder.cycle
from recorder import FlightRecorder
from recorder.cycle import StepCycle
from recorder.guard import OptimizerGuard
from recorder.hooks import Hook

aten = torch.ops.aten
FLIGHT = str(Path(recorder.cycle.__file__).resolve())  # the module that reads the host
RECORDER = str(Path(recorder.cycle.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
_MISSING = object()

# aten ops that read a value on the host, or sync inside C++ to size their output
READ_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
            aten.allclose.default, aten.nonzero.default, aten.masked_select.default,
            aten._unique.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.unique_dim_consecutive.default}
MASK_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default}
# Python-level reads that pass no aten op (or whose op is counted here instead)
READ_METHODS = ("tolist", "numpy", "cpu", "to")


class SyncLog(list):
    """``(kind, caller file)`` per sync; ``tensor_ids`` the id of the tensor each one read."""

    def __init__(self):
        super().__init__()
        self.tensor_ids: list[int | None] = []

    def note(self, kind: str, tensor) -> None:
        self.append((kind, _caller()))
        self.tensor_ids.append(id(tensor) if isinstance(tensor, torch.Tensor) else None)


def _caller() -> str:
    """The file of the innermost frame that is neither torch's nor this counter's."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(TORCH) and f.f_code not in _COUNTER_CODE:
            return str(Path(name).resolve())
        f = f.f_back
    return "?"


def _spells_host(t: torch.Tensor, args, kwargs) -> bool:
    """``t.to(...)`` asks for host memory: "cpu" written out, or a CPU target for a tensor on
    a device (a ``to`` onto the tensor's own device is a no-op on any machine)."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, str):
            return torch.device(a).type == "cpu"
        target = a.device if isinstance(a, torch.Tensor) else a
        if isinstance(target, torch.device):
            return target.type == "cpu" and t.device.type != "cpu"
    return False


def _boolean_index(args) -> bool:
    idx = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (idx or ()))


class _SyncOps(TorchDispatchMode):
    def __init__(self, log: SyncLog, busy: list):
        super().__init__()
        self.log, self.busy = log, busy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.busy:  # inside a counted Python read: counted there
            if func in READ_OPS or (func in MASK_OPS and _boolean_index(args)):
                self.log.note(func.__name__.split(".")[0], args[0] if args else None)
            elif func in COPY_OPS:
                src = args[1] if func is aten.copy_.default else args[0]
                dst = (args[0].device if func is aten.copy_.default
                       else kwargs.get("device") or src.device)
                if src.device.type != "cpu" and torch.device(dst).type == "cpu":
                    self.log.note("device-to-host copy", src)
        return func(*args, **kwargs)


@contextmanager
def count_host_reads() -> Iterator[SyncLog]:
    """Yields a :class:`SyncLog` that gets one entry per host read or sync (see above)."""
    log, busy = SyncLog(), []
    saved = {n: torch.Tensor.__dict__.get(n, _MISSING) for n in READ_METHODS}

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            if not busy and (name != "to" or _spells_host(self, args, kwargs)):
                log.note(name, self)
            busy.append(name)
            try:
                return original(self, *args, **kwargs)
            finally:
                busy.pop()

        _COUNTER_CODE.add(wrapper.__code__)
        return wrapper

    for name in READ_METHODS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    try:
        with _SyncOps(log, busy):
            yield log
    finally:
        for name, old in saved.items():
            if old is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


# (torch wraps a mode's __torch_dispatch__ to keep dynamo out: the counter's code is inside)
_COUNTER_CODE = {inspect.unwrap(_SyncOps.__torch_dispatch__).__code__, SyncLog.note.__code__}


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


def test_counter_sees_every_kind_of_sync():
    t = torch.tensor([1.5, 2.0, 1.5])
    mask = t > 1.6
    reads = [
        ("tolist", lambda: t.tolist()),
        ("_local_scalar_dense", lambda: float(t[0])),
        ("_local_scalar_dense", lambda: int(t[1])),
        ("_local_scalar_dense", lambda: bool(t[0] > 1)),
        ("_local_scalar_dense", lambda: t[0].item()),
        ("_local_scalar_dense", lambda: [10, 20, 30][torch.tensor(1)]),  # __index__
        ("cpu", lambda: t.cpu()),
        ("to", lambda: t.to("cpu")),
        ("numpy", lambda: t.numpy()),
        ("equal", lambda: torch.equal(t, t)),
        ("allclose", lambda: torch.allclose(t, t)),
        ("nonzero", lambda: t.nonzero()),
        ("index", lambda: t[mask]),
        ("index_put_", lambda: t.clone().__setitem__(mask, 0.0)),
        ("masked_select", lambda: t.masked_select(mask)),
        ("_unique2", lambda: t.unique()),
    ]
    for kind, read in reads:
        with count_host_reads() as calls:
            read()
        assert calls == [(kind, HERE)], (kind, calls)
    with count_host_reads() as calls:  # device work with no read: nothing
        u = t * 2
        t.to(torch.float64)
        t.to(t.device)  # a no-op on any machine
        torch.isfinite(u).all()
        t.isnan().any()
        t.masked_fill(mask, 0.0)
        t[torch.tensor([0, 2])]  # integer indices size their output without a read
    assert calls == []
    assert "tolist" not in torch.Tensor.__dict__  # restored


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


# ---------------------------------------------------------------------------------------------
# the paths that close a step differently, on CPU (counted) and on CUDA (sync debug mode)

STEPS = 4


def _sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # reads nothing itself


def _grad_scaler(device, out_dir):
    """float16 autocast with a GradScaler whose first scales overflow: skipped steps, then
    updates; the scale is read in the step's one sync."""
    model, crit = M.mlp().to(device), nn.CrossEntropyLoss()
    opt = _sgd(model)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 20)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, scaler=scaler) as rec:
        for step in range(STEPS):
            x, y = (t.to(device) for t in M.batch(step))
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = crit(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            yield
    assert rec.event is None and rec.step == STEPS


def _ddp(device, out_dir):
    """DistributedDataParallel in one process (gloo on CPU, nccl on CUDA): the recorder
    re-reads every gradient after the all-reduce, before the update."""
    assert not dist.is_initialized()
    store = out_dir.parent / "pg-store"
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=0, world_size=1)
    try:
        net = M.mlp().to(device)
        model = nn.parallel.DistributedDataParallel(net)
        crit, opt = nn.CrossEntropyLoss(), _sgd(model)
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
            for step in range(STEPS):
                x, y = (t.to(device) for t in M.batch(step))
                opt.zero_grad()
                crit(model(x), y).backward()
                opt.step()
                yield
        assert rec.event is None and rec.step == STEPS and rec.target.ddp
    finally:
        dist.destroy_process_group()


def _closure(device, out_dir):
    """``optimizer.step(closure)``: forward and backward inside step(), the step closed when
    the closure returns."""
    model, crit = M.mlp().to(device), nn.CrossEntropyLoss()
    opt = _sgd(model)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir) as rec:
        for step in range(STEPS):
            x, y = (t.to(device) for t in M.batch(step))

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            yield
    assert rec.event is None and rec.step == STEPS


def _record_loss(device, out_dir):
    """An inline loss handed over with ``record_loss``, checked in the step's read."""
    model = M.mlp().to(device)
    opt = _sgd(model)
    with FlightRecorder(model, opt, out_dir=out_dir) as rec:
        for step in range(STEPS):
            x, y = (t.to(device) for t in M.batch(step))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            rec.record_loss(loss)
            loss.backward()
            opt.step()
            yield
    assert rec.event is None and rec.step == STEPS


LR_TENSORS: list[torch.Tensor] = []


def _tensor_lr(device, out_dir):
    """A learning rate held in a tensor, changed by a scheduler every step. On CUDA it lives on
    the device (and the recorder must not read it there); on CPU it is host memory, whose read
    is no device sync (the test checks that such reads are of that tensor only)."""
    model, crit = M.mlp().to(device), nn.CrossEntropyLoss()
    lr = torch.tensor(0.05, device=device)
    LR_TENSORS[:] = [lr]
    opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, lr_scheduler=sched) as rec:
        for step in range(STEPS):
            x, y = (t.to(device) for t in M.batch(step))
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            sched.step()
            yield
    assert rec.event is None and rec.step == STEPS
    assert opt.param_groups[0]["lr"] is lr  # still the tensor, updated in place


SCENARIOS = {"grad_scaler": _grad_scaler, "ddp": _ddp, "closure": _closure,
             "record_loss": _record_loss, "tensor_lr": _tensor_lr}


def _recorder_syncs_per_step(scenario, device, out_dir) -> list[list[tuple[str, str]]]:
    """The syncs the recorder's own code made during each step, then after the loop (the
    loop's and torch's are not its: the GradScaler reads its found-inf flags, DDP and the
    optimizer may read). Reads of a host learning-rate tensor are checked and left out."""
    per_step, seen = [], 0
    with count_host_reads() as calls:
        for _ in scenario(device, out_dir):
            per_step.append([(c, i) for c, i in zip(calls[seen:], calls.tensor_ids[seen:])
                             if c[1].startswith(RECORDER)])
            seen = len(calls)
        # after the loop: the with block's exit closes a step still open
        per_step.append([(c, i) for c, i in zip(calls[seen:], calls.tensor_ids[seen:])
                         if c[1].startswith(RECORDER)])
    lr_ids = {id(t) for t in LR_TENSORS}
    out = []
    for step in per_step:
        host_lr = [c for c, i in step if i in lr_ids]
        assert all(kind == "_local_scalar_dense" and f == FLIGHT for kind, f in host_lr), step
        out.append([c for c, i in step if i not in lr_ids])
    return out


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "grad_scaler"])
def test_one_host_read_per_step_on_every_step_path(out_dir, name):
    per_step = _recorder_syncs_per_step(SCENARIOS[name], torch.device("cpu"), out_dir)
    # one read per step (the probe, read as a list of four numbers), and at the with block's
    # exit one more: the evidence of the last update, which no next step reads
    assert per_step == [[("tolist", FLIGHT)]] * STEPS + [[("tolist", FLIGHT)]], per_step


def test_one_host_read_per_step_with_a_grad_scaler(out_dir):
    """A step the scaler skipped is closed by the next forward (or the with block's exit), so
    its read falls in the next step's window; each read covers the probe and the scale."""
    per_step = _recorder_syncs_per_step(_grad_scaler, torch.device("cpu"), out_dir)
    assert all(read == ("tolist", FLIGHT) for window in per_step for read in window), per_step
    assert sum(map(len, per_step)) == STEPS, per_step
    assert [len(w) for w in per_step] != [1] * STEPS + [0]  # some steps were skipped


def test_the_counter_catches_syncs_inside_the_recorder(out_dir, monkeypatch):
    """Control: a recorder that closed its step with C++ syncs (``equal``, ``nonzero``,
    boolean-mask indexing, ``unique``) or a host copy would be seen, each once per step and
    attributed to the recorder's code."""
    original = OptimizerGuard.before_update

    def syncing(self, optimizer):
        w = next(iter(self.target.params))[1].detach()
        torch.equal(w, w)
        w.nonzero()
        w[w > 0]
        w.unique()
        w.cpu()
        return original(self, optimizer)

    syncing.__code__ = syncing.__code__.replace(co_filename=FLIGHT)  # as if written there
    monkeypatch.setattr(OptimizerGuard, "before_update", syncing)
    model, crit = M.mlp(), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
        per_step = _per_step(model, opt, crit, 3)
    expected = ["equal", "nonzero", "index", "_unique2", "cpu", "tolist"]
    assert per_step == [[(k, FLIGHT) for k in expected]] * 3, per_step


@contextmanager
def recorder_in_sync_error_mode(monkeypatch) -> Iterator[list[str]]:
    """Every entry into the recorder (its hooks, the closure it wraps, ``record_loss``) runs
    under ``torch.cuda.set_sync_debug_mode("error")``: any sync there raises, except the step's
    one read in ``StepCycle.close_tape``, let through and listed in the yielded list."""
    allowed: list[str] = []
    # the step's probe, and the last update's evidence at the exit
    READS = {recorder.cycle._read_probe.__code__, StepCycle.check_last_update.__code__}

    def strict(fn):
        def entry(*args, **kwargs):
            old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(old)

        return entry

    def budget(name, original):
        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code not in READS:
                return original(self, *args, **kwargs)
            old = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("default")
            try:
                allowed.append(name)
                return original(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(old)

        return read

    monkeypatch.setattr(Hook, "__call__", strict(Hook.__call__))
    monkeypatch.setattr(OptimizerGuard, "after_closure", strict(OptimizerGuard.after_closure))
    monkeypatch.setattr(FlightRecorder, "record_loss", strict(FlightRecorder.record_loss))
    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, budget(name, getattr(torch.Tensor, name)))
    try:
        yield allowed
    finally:
        monkeypatch.undo()


@requires_cuda
@pytest.mark.parametrize("name", ["plain", *SCENARIOS])
def test_no_sync_in_the_recorders_hooks_on_cuda(out_dir, name, monkeypatch):
    device = torch.device("cuda")
    scenario = SCENARIOS.get(name) or _plain
    with recorder_in_sync_error_mode(monkeypatch) as allowed:
        for _ in scenario(device, out_dir):
            pass
    # one per step and, as on the CPU, one at the exit where an update's evidence is left
    # (a GradScaler run's reads cover it); nothing else synced, or it would have raised
    assert len(allowed) == (STEPS if name == "grad_scaler" else STEPS + 1), allowed


def _plain(device, out_dir):
    model, crit = M.mlp().to(device), nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, stats="full") as rec:
        for step in range(STEPS):
            x, y = (t.to(device) for t in M.batch(step))
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            yield
    assert rec.event is None and rec.step == STEPS
