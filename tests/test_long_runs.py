"""A recorder left switched on for a long run: it holds no more objects at the end than after
its warm-up, and after its ring buffer wrapped many times the bundle's history is the last
``history`` steps in order, each with the loss and learning rate the run had, and a rewind
window is the copy's steps up to the event.

The loop is a user's long run: gradient accumulation over 4 micro-batches, a model returning a
dict, batches the loader makes anew every step, of varying length and a smaller last batch per
epoch, a validation forward under ``no_grad`` every 50 steps.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from torch import nn

import replay
from recorder import FlightRecorder, NonFiniteError

VOCAB, DIM = 20, 16
ACCUMULATE = 4


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, ids):
        h = torch.relu(self.lin(self.emb(ids))).mean(1)
        return {"logits": self.head(h), "features": h}


def batches(step: int):
    """A step's micro-batches, made anew: lengths 5..11, the epoch's last batch of 3 rows."""
    g = torch.Generator().manual_seed(step)
    for mb in range(ACCUMULATE):
        rows = 3 if step % 10 == 9 and mb == ACCUMULATE - 1 else 8
        ids = torch.randint(0, VOCAB, (rows, 5 + (step + mb) % 7), generator=g)
        yield ids, torch.randint(0, 3, (rows,), generator=g)


def held(rec: FlightRecorder | None) -> dict:
    """What the process holds: tensors, the recorder's objects, hooks' partials and handles
    (by type, never ``isinstance``, which wakes torch's deprecated module proxies), and the
    length of every container the recorder's parts keep."""
    gc.collect()
    kinds: Counter = Counter()
    for o in gc.get_objects():
        t = type(o)
        module = t.__dict__.get("__module__")  # (a class's own: a metaclass's is a descriptor)
        if issubclass(t, torch.Tensor):
            kinds["tensor"] += 1
        elif isinstance(module, str) and module.startswith(("recorder", "replay")) \
                or t.__name__ in ("partial", "RemovableHandle", "weakref", "ReferenceType"):
            kinds[f"{module}.{t.__name__}"] += 1
    sizes: dict = {}
    if rec is not None:
        _container_sizes(rec, "rec", sizes, set(), 0)
    return {"objects": dict(kinds), "containers": sizes}


def _container_sizes(obj, name: str, out: dict, seen: set, depth: int) -> None:
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (list, dict, set, tuple)) or type(obj).__name__ == "deque":
        out[name] = len(obj)
    fields = getattr(obj, "__dict__", None)
    if fields and type(obj).__module__.startswith("recorder"):
        for k, v in fields.items():
            _container_sizes(v, f"{name}.{k}", out, seen, depth + 1)


def long_run(tmp_path, steps: int, record: bool, at: tuple[int, ...] = ()):
    torch.manual_seed(0)
    model = DictNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    rec = FlightRecorder(model, opt, loss_fn=crit, out_dir=tmp_path, rewind=25) \
        if record else None
    losses, seen = [], {}
    with rec or torch.enable_grad():
        for step in range(steps):
            opt.zero_grad()
            total = 0.0
            for ids, y in batches(step):
                loss = crit(model(ids)["logits"], y) / ACCUMULATE
                loss.backward()
                total += loss.item()
            opt.step()
            losses.append(total)
            if step % 50 == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.randint(0, VOCAB, (5, 6)))
                model.train()
            if step + 1 in at:
                seen[step + 1] = held(rec)
    return losses, seen


def test_long_run_holds_nothing_more_per_step(tmp_path):
    """Steps 100 to 200 (two evaluations and ten short epoch-end batches among them) leave
    the tensors, the recorder's objects and its containers as they were (a leak of tapes,
    batches, hooks or records grows them by a hundred); training is bit-identical with the
    recorder and no bundle is written."""
    losses, seen = long_run(tmp_path, 200, True, at=(100, 200))
    # (the process's counts may fall meanwhile, as objects earlier tests left in the same
    # worker are freed; a leak makes one grow)
    before, after = seen[100]["objects"], seen[200]["objects"]
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, grew
    assert seen[200]["containers"] == seen[100]["containers"]
    assert not list(tmp_path.iterdir())
    assert losses == long_run(tmp_path, 200, False)[0]


# ---------------------------------------------------------------------------------------------
# the ring wrapped


EVENT, SPIKE, BAD_ROW, EVERY = 1000, 997, 2, 16


def wrapped_run(out_dir):
    """A regression trained for ``EVENT`` steps with the default history (wrapped 15 times); the
    learning rate is 500x for one step at ``SPIKE``; a NaN feature in row ``BAD_ROW`` of the
    batch at ``EVENT``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    crit = nn.MSELoss()
    losses, lrs = {}, {}
    with pytest.raises(NonFiniteError) as info:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir, rewind=EVERY):
            for step in range(EVENT + 1):
                x, y = torch.randn(6, 4), torch.randn(6, 1)
                if step == EVENT:
                    x[BAD_ROW, 1] = float("nan")
                opt.param_groups[0]["lr"] = lrs[step] = 5.0 if step == SPIKE else 1e-2
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                opt.step()
                losses[step] = loss.item()
    return info.value.bundle_path, losses, lrs


def test_history_after_the_ring_wrapped(tmp_path):
    path, losses, lrs = wrapped_run(tmp_path)
    report = replay.replay(path)
    event, hist = report["event"], report["history"]
    assert (event["step"], event["phase"], event["samples"]) == (EVENT, "input", [BAD_ROW])
    kept = FlightRecorder.__init__.__kwdefaults__["history"]
    assert hist["steps"] == list(range(EVENT - kept + 1, EVENT + 1))
    for step, loss, lr in zip(hist["steps"], hist["loss"], hist["lr"]):
        if step < EVENT:  # (the event step's forward raised before its loss)
            assert loss == pytest.approx(losses[step], rel=1e-6), step
        assert lr == [lrs[step]], step
    kinds = {(p["step"], p["kind"]) for p in report["precursors"]}
    assert (SPIKE, "lr_jump") in kinds and (SPIKE + 1, "loss_jump") in kinds
    # the window: the older of the two copies taken every EVERY steps, to the event
    copy = EVENT - EVENT % EVERY - EVERY
    window = report["window"]
    assert (window["copy_step"], window["steps"]) == (copy, [copy, EVENT])
    assert window["reproduced"] and window["precursors_began"]["step"] == SPIKE
    per_step = {s["step"]: s for s in window["per_step"]}
    assert sorted(per_step) == list(range(copy, EVENT + 1))
    for step in range(copy, EVENT):
        assert per_step[step]["loss"] == pytest.approx(losses[step], rel=1e-5), step
        assert per_step[step]["lr"] == lrs[step]
