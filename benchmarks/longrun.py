#!/usr/bin/env python
"""Does the recorder's per-step cost or memory drift over a long run?

Two parts, in one process each:

- ``drift``: a bare copy and a recorded copy of the same model (``overhead.py``'s ``Trainer``
  and ``Recorder``) take single steps in alternation, whoever goes first rotating, for
  ``--steps`` steps; the recorded/bare step-time ratio's median over the first 500 steps is
  compared with the last 500's. Beside it: the process's RSS, the live Python objects and
  tensors (``gc``), the recorder's ``memory_bytes`` and the sizes of every container the
  recorder holds (lists, dicts, sets, deques, weak tables), at the start and at the end.
- ``features``: a recorded run with what long runs use: a DataLoader with 2 workers (new
  workers every epoch), gradient accumulation (4 micro-batches), a LR scheduler, an evaluation
  pass every 200 steps (``model.eval()`` + ``no_grad``) and a checkpoint every 500 steps
  (``torch.save`` of the model's, optimizer's and scheduler's state_dicts), the same counts
  taken every 1000 steps.

A container of the recorder that grows with the steps is printed with its attribute path.

    python benchmarks/longrun.py [--models mlp,lm_tiny] [--steps 5000] [--parts drift,features]
                                 [--threads 1] [--json out.json] [--quick]

Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import collections
import gc
import io
import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import overhead as O  # noqa: E402

from recorder import FlightRecorder  # noqa: E402

WINDOW = 500  # steps compared at the start and at the end
WARMUP = 100  # steps before the first count: more than the ring's 64 rows of history
SPECS = {
    "mlp": O.ModelSpec("mlp", lambda: O.MLP(width=128), lambda g, d: (
        torch.randn(32, 128, generator=g).to(d), torch.randint(0, 10, (32,), generator=g).to(d)),
        "5-layer MLP, width 128, batch 32"),
    "lm_tiny": O.ModelSpec("lm_tiny", lambda: O.Transformer(vocab=256, d=32, layers=2, seq=32),
                           lambda g, d: _tokens(g, d), "2-layer causal transformer, d=32, seq 32,"
                           " batch 8", flatten=True),
}


def _tokens(g, device):
    t = torch.randint(0, 256, (8, 33), generator=g)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


# ----------------------------------------------------------------------------------------------
# what the process and the recorder hold


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def live_objects() -> tuple[int, int]:
    """(live gc-tracked Python objects, live tensors), after a full collection."""
    gc.collect()
    objs = gc.get_objects()
    return len(objs), sum(1 for o in objs if issubclass(type(o), torch.Tensor))  # (no isinstance: a
    # deprecated torch alias warns when its __class__ is read)


_OPAQUE = (nn.Module, torch.Tensor, torch.optim.Optimizer, type, Path, str, bytes,
           torch.utils.data.DataLoader, torch.optim.lr_scheduler.LRScheduler)


def census(root, depth: int = 8) -> dict[str, int]:
    """Length of every container reachable from ``root`` through attributes, items and values
    (not into models, tensors, optimizers), keyed by its first path."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    todo = collections.deque([("rec", root, 0)])
    while todo:
        path, obj, d = todo.popleft()
        if id(obj) in seen or d > depth or isinstance(obj, _OPAQUE) or callable(obj) \
                and not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        for name, child in _children(obj):
            todo.append((f"{path}{name}", child, d + 1))
        if isinstance(obj, (list, dict, set, frozenset, collections.deque, tuple,
                            weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
                            weakref.WeakSet)):
            sizes[path] = len(obj)
    return sizes


def _children(obj):
    if isinstance(obj, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
        return [(f"[{i}]", v) for i, v in enumerate(list(obj.values())[:64])]
    if isinstance(obj, dict):
        return [(f"[{k!r}]" if isinstance(k, (str, int)) else f"[#{i}]", v)
                for i, (k, v) in enumerate(list(obj.items())[:64])]
    if isinstance(obj, (list, tuple, collections.deque, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(list(obj)[:64])]
    if isinstance(obj, weakref.ref):
        return []
    names = list(getattr(obj, "__dict__", {}) or {})
    for klass in type(obj).__mro__:
        names += [s for s in getattr(klass, "__slots__", ()) if isinstance(s, str)]
    if not names or type(obj).__module__.split(".")[0] not in ("recorder", "builtins"):
        return []
    out = []
    for n in names:
        try:
            out.append((f".{n}", getattr(obj, n)))
        except AttributeError:
            pass
    return out


def module_census() -> dict[str, int]:
    """The same for the recorder's module-level containers and functools caches."""
    sizes: dict[str, int] = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] != "recorder":
            continue
        for attr, value in vars(mod).items():
            if hasattr(value, "cache_info"):
                sizes[f"{name}.{attr}()"] = value.cache_info().currsize
            elif not attr.startswith("__") and isinstance(value, (list, dict, set)) or \
                    isinstance(value, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def hook_count(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Hooks registered on the model's modules, its parameters and the optimizer (torch's own
    dicts of them)."""
    tensor_hooks = ("_backward_hooks", "_post_accumulate_grad_hooks")  # (C properties)
    n = sum(len(getattr(p, k) or ()) for p in model.parameters() for k in tensor_hooks)
    return n + sum(len(d) for h in [*model.modules(), opt] for k, d in vars(h).items()
                   if k.endswith("_hooks") and isinstance(d, dict))


def snapshot(recorder: FlightRecorder, model: nn.Module, opt) -> dict:
    sizes = census(recorder) | module_census()  # (first: its own one-off allocations counted)
    objects, tensors = live_objects()
    return {"rss": rss_bytes(), "objects": objects, "tensors": tensors,
            "hooks": hook_count(model, opt), "memory_bytes": dict(recorder.memory_bytes),
            "census": sizes}


def grown(before: dict[str, int], after: dict[str, int], slack: int = WARMUP) -> list[str]:
    """Containers more than ``slack`` entries longer at the end (new ones at their size): more
    than any bounded window of the recorder (its ring, a rewind window) moves between two counts."""
    rows = []
    for path, n in sorted(after.items()):
        was = before.get(path, 0)
        if n - was > slack:
            rows.append(f"{path}: {was} -> {n}")
    return rows


# ----------------------------------------------------------------------------------------------
# part 1: drift of the ratio and of the memory, bare and recorded in alternation


def drift(model: str, steps: int, tmp: str) -> dict:
    spec = SPECS[model]
    g = torch.Generator().manual_seed(O.SEED)
    batches = [spec.make_batch(g, torch.device("cpu")) for _ in range(16)]
    bare = O.Trainer(spec, torch.device("cpu"), tmp)
    rec = O.Recorder(spec, torch.device("cpu"), tmp)
    for i in range(WARMUP):  # lazy allocations, first layouts, the ring's history filled
        bare.step(*batches[i % 16])
        rec.step(*batches[i % 16])
    start = snapshot(rec.recorder, rec.model, rec.opt)
    ratios: list[float] = []
    bare_ms: list[float] = []
    started = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % 16]
        pair = (bare, rec) if i % 2 else (rec, bare)
        dt = {}
        for t in pair:
            t0 = time.perf_counter()
            t.step(x, y)
            dt[t.name] = time.perf_counter() - t0
        ratios.append(dt["recorder"] / dt["bare"])
        bare_ms.append(dt["bare"] * 1e3)
        if i % 1000 == 999:
            print(f"  {model} drift: {i + 1}/{steps} steps, {time.perf_counter() - started:.0f}"
                  " s", file=sys.stderr)
    end = snapshot(rec.recorder, rec.model, rec.opt)
    cycles = {t.name: cyclic_garbage(t, batches) for t in (bare, rec)}
    rec.close()
    return {"model": model, "describe": spec.describe, "steps": steps,
            "ratio_first": statistics.median(ratios[:WINDOW]),
            "ratio_last": statistics.median(ratios[-WINDOW:]),
            "ratio_by_window": [round(statistics.median(ratios[i:i + WINDOW]), 3)
                                for i in range(0, steps, WINDOW)],
            "bare_ms_first": statistics.median(bare_ms[:WINDOW]),
            "bare_ms_last": statistics.median(bare_ms[-WINDOW:]),
            "start": _plain(start), "end": _plain(end), "cyclic_garbage_per_step": cycles,
            "grown": grown(start["census"], end["census"])}


def cyclic_garbage(trainer: O.Trainer, batches, steps: int = 200) -> float:
    """Objects per step left in reference cycles (only the cyclic collector frees them: its
    passes then cost the loop time), counted with the collector off."""
    gc.collect()
    gc.disable()
    try:
        for i in range(steps):
            trainer.step(*batches[i % len(batches)])
        return gc.collect() / steps
    finally:
        gc.enable()


def _plain(snap: dict) -> dict:
    return {k: v for k, v in snap.items() if k != "census"} | {
        "containers": len(snap["census"]), "entries": sum(snap["census"].values())}


# ----------------------------------------------------------------------------------------------
# part 2: a recorded run with a long run's features


class _Data(torch.utils.data.Dataset):
    def __init__(self, spec, n: int):
        g = torch.Generator().manual_seed(O.SEED)
        self.rows = [spec.make_batch(g, torch.device("cpu")) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _unbatch(spec, x, y):
    return x.flatten(0, 1), y.flatten(0, 1)  # a loader item is a whole small batch


def features(model: str, steps: int, tmp: str, rewind: int | None, accum: int = 4) -> dict:
    spec = SPECS[model]
    torch.manual_seed(O.SEED)
    net, crit = spec.build(), nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    loader = torch.utils.data.DataLoader(_Data(spec, 64), batch_size=1, shuffle=True,
                                         num_workers=2)
    held = _Data(spec, 4).rows
    marks: list[dict] = []
    started = time.perf_counter()
    with FlightRecorder(net, opt, loss_fn=crit, out_dir=f"{tmp}/features-{model}",
                        lr_scheduler=sched, rewind=rewind) as rec:
        step, it = 0, iter(loader)
        while step < steps:
            for _ in range(accum):
                try:
                    x, y = next(it)
                except StopIteration:  # a new epoch: the loader's workers start again
                    it = iter(loader)
                    x, y = next(it)
                x, y = _unbatch(spec, x, y)
                loss = crit(*spec.loss_args(net(x), y)) / accum
                loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 200 == 0:
                _evaluate(net, crit, spec, held)
            if step % 500 == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                            "sched": sched.state_dict()}, io.BytesIO())
            if step in (WARMUP, steps) or step % 1000 == 0:
                marks.append({"step": step} | snapshot(rec, net, opt))
                print(f"  {model} features: {step}/{steps} steps, "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return {"model": model, "steps": steps, "rewind": rewind, "marks": [_plain(m) for m in marks],
            "grown": grown(marks[0]["census"], marks[-1]["census"])}


def _evaluate(net, crit, spec, held) -> None:
    net.eval()
    with torch.no_grad():
        for x, y in held:
            crit(*spec.loss_args(net(x), y))
    net.train()


# ----------------------------------------------------------------------------------------------
# output


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}"


def render(results: list[dict]) -> str:
    lines = ["| model | steps | ratio, first 500 | ratio, last 500 | RSS start → end (MiB) | "
             "gc objects start → end | tensors start → end | hooks | recorder bytes start → end | "
             "containers grown |", "|---|---|---|---|---|---|---|---|---|---|"]
    if not any("ratio_first" in r for r in results):
        lines = []
    for r in results:
        if "ratio_first" not in r:
            continue
        s, e = r["start"], r["end"]
        lines.append(
            f"| {r['model']} | {r['steps']} | {r['ratio_first']:.3f} | {r['ratio_last']:.3f} | "
            f"{_mb(s['rss'])} → {_mb(e['rss'])} | {s['objects']} → {e['objects']} | "
            f"{s['tensors']} → {e['tensors']} | {s['hooks']} → {e['hooks']} | {sum(s['memory_bytes'].values())} → "
            f"{sum(e['memory_bytes'].values())} | {len(r['grown'])} |")
    for r in results:
        if "ratio_by_window" in r:
            lines.append(f"- {r['model']}: ratio by {WINDOW}-step window "
                         f"{r['ratio_by_window']}; bare step {r['bare_ms_first']:.2f} ms first,"
                         f" {r['bare_ms_last']:.2f} ms last; objects per step left in reference cycles "
                         f"{r['cyclic_garbage_per_step']}")
    for r in results:
        if "marks" not in r:
            continue
        lines += ["", f"features, {r['model']}, rewind={r['rewind']}: DataLoader(num_workers=2), 4 micro-batches, "
                  "CosineAnnealingLR, eval every 200, torch.save every 500", "",
                  "| step | RSS (MiB) | gc objects | tensors | hooks | recorder bytes | "
                  "container entries |", "|---|---|---|---|---|---|---|"]
        for m in r["marks"]:
            lines.append(f"| {m['step']} | {_mb(m['rss'])} | {m['objects']} | {m['tensors']} |"
                         f" {m['hooks']} | {sum(m['memory_bytes'].values())} | {m['entries']} |")
    for r in results:
        for row in r["grown"]:
            lines.append(f"- grew ({r['model']}, {'drift' if 'start' in r else 'features'}): "
                         f"{row}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,lm_tiny")
    ap.add_argument("--parts", default="drift,features")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--feature-steps", type=int, default=1500)
    ap.add_argument("--rewind", type=int, default=None,
                    help="the features run's recorder with rewind=N")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="60 steps: checks that it runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = WARMUP + 60 if args.quick else args.steps
    fsteps = WARMUP + 60 if args.quick else args.feature_steps
    results = []
    with tempfile.TemporaryDirectory(prefix="nanreplay-longrun-") as tmp:
        for model in args.models.split(","):
            if "drift" in args.parts:
                results.append(drift(model, steps, tmp))
            if "features" in args.parts:
                results.append(features(model, fsteps, tmp, args.rewind))
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
