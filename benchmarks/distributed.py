#!/usr/bin/env python
"""Per-step overhead of the recorder under DDP and FSDP2 on two ranks, side by side.

Launches itself under ``torchrun`` (2 gloo ranks on CPU by default). In each rank, for each
setup, two copies of the same model (same seed) are wrapped the same way (``DistributedDataParallel``,
or nested FSDP2 ``fully_shard``: every block, then the root), each with its own AdamW: one bare,
one with a ``FlightRecorder`` attached for the whole run. Training steps (zero_grad, forward,
cross-entropy, backward, optimizer.step) alternate between the copies, on the same batch within
a round, the first copy alternating every round; both ranks run the same rounds in lockstep
(their collectives pair up). Each recorded step's time is divided by the bare step of the same
round; rank 0 prints the median ratio, its interquartile range and the median step times.

The recorder's cost under torch.distributed includes its per-step agreement: one 2-float
all-reduce folded into the step's one host read (``recorder.ranks``).

    python benchmarks/distributed.py [--setups ddp,fsdp2] [--rounds N] [--width W]
                                     [--json out.json] [--quick]

Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234


def _model(width: int, depth: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.act = nn.GELU()
            self.down = nn.Linear(4 * width, width)
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            return self.norm(x + self.down(self.act(self.up(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(32, width)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(width, 10)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(SEED)
    return Net()


def _wrap(model, setup: str):
    from torch import nn

    if setup == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    sys.path.insert(0, str(ROOT))
    from recorder import FlightRecorder

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    crit = nn.CrossEntropyLoss()
    results = {}
    g = torch.Generator().manual_seed(SEED + rank)
    for setup in args.setups.split(","):
        copies = {}
        for name in ("bare", "recorder"):
            model = _wrap(_model(args.width, args.depth), setup)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            copies[name] = (model, opt)
        tmp = tempfile.mkdtemp(prefix="nanreplay-bench-")
        rec = FlightRecorder(*copies["recorder"], loss_fn=crit, out_dir=tmp).attach()

        def step(name, x, y, copies=copies):
            model, opt = copies[name]
            dist.barrier()  # both ranks start the timed step together
            t0 = time.perf_counter()
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        times = {"bare": [], "recorder": []}
        for r in range(args.warmup + args.rounds):
            x = torch.randn(args.batch, 32, generator=g)
            y = torch.randint(0, 10, (args.batch,), generator=g)
            order = ("bare", "recorder") if r % 2 == 0 else ("recorder", "bare")
            took = {name: step(name, x, y) for name in order}
            if r >= args.warmup:
                for name, t in took.items():
                    times[name].append(t)
        reads = {name: _count_reads(partial(step, name, x, y)) for name in times}
        rec.detach()
        ratios = sorted(a / b for a, b in zip(times["recorder"], times["bare"]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        results[setup] = {"bare_ms": statistics.median(times["bare"]) * 1e3,
                          "recorder_ms": statistics.median(times["recorder"]) * 1e3,
                          "ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
                          "rounds": len(ratios), "reads_bare": reads["bare"],
                          "reads_recorder": reads["recorder"]}
        if rank == 0:
            print(f"{setup}: done", file=sys.stderr, flush=True)
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def _count_reads(run, steps: int = 3) -> float:
    """Host reads of tensors (``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``,
    ``__int__``) per step over ``steps`` untimed steps; reads of 0-d CPU ``step`` counters by
    the optimizer are counted too, alike for both copies."""
    import torch

    count = [0]
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(fn):
        def counted(self, *a, **k):
            count[0] += 1
            return fn(self, *a, **k)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        for _ in range(steps):
            run()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return count[0] / steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default="ddp,fsdp2")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--json", dest="json_out")
    p.add_argument("--quick", action="store_true", help="1 warm-up + 3 rounds: runs, no figures")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.warmup, args.rounds = 1, 3
    if args.worker:
        return _worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", __file__, "--worker", "--setups", args.setups,
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--width", str(args.width),
           "--depth", str(args.depth), "--batch", str(args.batch)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"distributed.py: torchrun failed (exit {proc.returncode})")
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"2 ranks (gloo, CPU), width {args.width}, depth {args.depth}, batch {args.batch} "
          f"per rank\n")
    print("| setup | bare ms/step | recorder ms/step | recorder / bare (median) | IQR | rounds "
          "| host reads/step bare, recorder |")
    print("|---|---:|---:|---:|---|---:|---|")
    for setup, r in results.items():
        print(f"| {setup} | {r['bare_ms']:.2f} | {r['recorder_ms']:.2f} | {r['ratio']:.3f}x | "
              f"{r['q1']:.3f}-{r['q3']:.3f} | {r['rounds']} | {r['reads_bare']:g}, "
              f"{r['reads_recorder']:g} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
