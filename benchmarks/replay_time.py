#!/usr/bin/env python
"""How long ``replay(bundle)`` takes for a small causal transformer (bisection included).

Trains a 4-layer causal transformer (d=256, 4 heads, sequence 128, batch 8, AdamW, cross
entropy) under ``FlightRecorder`` until a bug planted at step 3 fires, then runs
``replay(path)`` ``--repeats`` times (rebuild from the factory, two re-runs, instrumented pass,
bisection, op finder, float64 re-run, precursors) and prints the median wall time. Target: at
most 10 s on a 2-core CPU. The bugs (``--bug``):

- ``masked-row`` (default): one sequence is left-padded, so the first queries of that row see
  only padding keys, the row's scores are all -inf after the mask and softmax makes NaN; the
  origin is early (``blocks.0.attn``), cause ``invalid``;
- ``late-masked-row``: the same, in a model whose last block alone applies the padding mask
  (the others are causal only), so the origin is late (``blocks.3.attn``) and bisection, op
  finder and the float64 re-run go through most of the forward.

    python benchmarks/replay_time.py [--bug masked-row|late-masked-row] [--repeats 3]
                                     [--rewind N] [--profile out.pstats] [--json out.json]

``--rewind N`` records with ``FlightRecorder(..., rewind=N)`` and plants the bug at step
``2N - 1``, so the bundle's window is the longest one (2N steps, from the copy at step 0): the
replay then re-runs that window as well (``replay.window``), and its time is the window's cost.

Wall times on a shared machine swing with its load (two threads of a CPU-bound process behind
other work wait at every parallel region); the plain training step measured alongside gives
the replay's cost in steps, and ``OMP_NUM_THREADS=1`` gives steadier numbers.

The replay trusts the recorded factory (``replay_time:make_model``) because the script runs it
from this directory, as a user runs ``nanreplay`` from their project root.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

VOCAB, DIM, HEADS, LAYERS, CTX, BATCH = 512, 256, 4, 4, 128, 8
BAD_STEP = 3


class Attention(nn.Module):
    def __init__(self, use_pad: bool = True):
        super().__init__()
        self.use_pad = use_pad
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("future", torch.ones(CTX, CTX, dtype=torch.bool).triu(1))

    def forward(self, x, pad):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS)
        hidden = self.future[:t, :t]
        if self.use_pad:
            hidden = hidden | pad[:, None, None, :]  # future or padding keys
        scores = scores.masked_fill(hidden, float("-inf"))
        attn = torch.softmax(scores, dim=-1)  # NaN for a row whose keys are all hidden
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self, use_pad: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention(use_pad)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, pad):
        x = x + self.attn(self.ln1(x), pad)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, pad_from: int = 0):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(CTX, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block(i >= pad_from) for i in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx, pad):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, pad)
        return self.head(self.ln(x))


def make_model() -> nn.Module:
    return GPT()


def make_late_model() -> nn.Module:
    """Only the last block applies the padding mask."""
    return GPT(pad_from=LAYERS - 1)


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=g)
    pad = torch.zeros(BATCH, CTX, dtype=torch.bool)
    if step == BAD_STEP:
        pad[5, :16] = True  # a left-padded sequence: its first queries see only padding
    return seq[:, :-1], pad, seq[:, 1:]


def record(out_dir: Path, bug: str, rewind: int | None = None) -> tuple[Path, float]:
    from recorder import FlightRecorder, NonFiniteError

    torch.manual_seed(0)
    factory = "make_model" if bug == "masked-row" else "make_late_model"
    model = globals()[factory]()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    crit = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    try:
        with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                            factory=f"replay_time:{factory}", rewind=rewind):
            for step in range(BAD_STEP + 3):
                idx, pad, y = batch(step)
                opt.zero_grad()
                loss = crit(model(idx, pad).reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                opt.step()
    except NonFiniteError as e:
        return e.bundle_path, time.perf_counter() - t0
    raise SystemExit("the planted NaN did not fire")


def step_time(bug: str, repeats: int) -> float:
    """Median seconds of one plain training step (forward, loss, backward) of the same model
    on the same batch, no recorder: the unit to read the replay time in, on a noisy machine."""
    torch.manual_seed(0)
    model = make_model() if bug == "masked-row" else make_late_model()
    crit = nn.CrossEntropyLoss()
    idx, pad, y = batch(0)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.zero_grad()
        crit(model(idx, pad).reshape(-1, VOCAB), y.reshape(-1)).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bug", choices=["masked-row", "late-masked-row"], default="masked-row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rewind", type=int, default=None,
                    help="record with rewind=N, the bug at step 2N-1: the window is 2N steps")
    ap.add_argument("--profile", type=Path, help="write cProfile stats of one more replay here")
    ap.add_argument("--json", type=Path, help="also write the numbers as JSON")
    args = ap.parse_args()

    if args.rewind:
        global BAD_STEP
        BAD_STEP = 2 * args.rewind - 1
    os.chdir(HERE)  # the recorded factory is trusted from here
    from replay import replay

    with tempfile.TemporaryDirectory(prefix="nanreplay-replay-time-") as tmp:
        path, train_s = record(Path(tmp), args.bug, args.rewind)
        print(f"recorded {path.name} after {train_s:.1f} s of training", file=sys.stderr)
        times, report = [], None
        cpu = []  # process CPU seconds (all threads): another view of a noisy machine
        for i in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            report = replay(path)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            print(f"replay {i + 1}/{args.repeats}: {times[-1]:.2f} s ({cpu[-1]:.2f} s CPU)",
                  file=sys.stderr)
        step_s = step_time(args.bug, args.repeats)
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(replay, path)
            prof.dump_stats(args.profile)
    o = report["origin"]
    summary = {
        "model": f"{LAYERS}-layer causal transformer d={DIM} heads={HEADS} seq={CTX} "
                 f"batch={BATCH} vocab={VOCAB}",
        "params": sum(p.numel() for p in make_model().parameters()),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "bug": args.bug, "rewind": args.rewind,
        "window": (report.get("window") or {}).get("steps"),
        "window_reproduced": (report.get("window") or {}).get("reproduced"), "replay_s": times, "replay_cpu_s": cpu, "train_step_s": step_s,
        "replay_in_steps": statistics.median(times) / step_s, "median_s": statistics.median(times),
        "origin": {"module": o["module"], "op": o["op"], "cause": report["cause"],
                   "reproduced": report["reproduced"], "bisection": report["bisection"]},
    }
    print(f"| model | replay median (s) | runs (s) | training step (s) | origin |\n"
          f"|---|---|---|---|---|\n"
          f"| {summary['model']} | {summary['median_s']:.2f} | "
          f"{', '.join(f'{t:.2f}' for t in times)} | {step_s:.2f} | {o['module']} {o['op']} "
          f"({report['cause']}, bisection {report['bisection']['probes']} probes) |")
    if args.rewind:
        print(f"rewind={args.rewind}: window of steps {summary['window']} re-run, event "
              f"{'reproduced' if summary['window_reproduced'] else 'NOT reproduced'}")
    print(f"median replay time: {summary['median_s']:.2f} s "
          f"({summary['replay_in_steps']:.1f} training steps of {step_s:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    expected = "blocks.0.attn" if args.bug == "masked-row" else f"blocks.{LAYERS - 1}.attn"
    if not (report["reproduced"] and o["module"] == expected and o["op"] == "aten._softmax"
            and report["bisection"]["agrees"]):
        print(f"unexpected report: origin {o['module']} {o['op']}, reproduced "
              f"{report['reproduced']}, bisection {report['bisection']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
