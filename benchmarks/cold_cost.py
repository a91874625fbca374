"""What a detector's per-step Python costs once a training step has run: the same call timed
right after a bare step of a benchmark model (its kernels have just streamed weights, gradients
and optimizer state through the CPU's caches) and right after itself, interleaved, medians; and
the Python opcodes a step of each copy executes in the detector's own code (``sys.settrace``).

    python benchmarks/cold_cost.py [--model mlp] [--rounds 200]

Why: on the MLP the recorder's distance to the floor is Python bookkeeping, and what that costs
per opcode depends on what the step left in the caches, not on the opcode alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import overhead as O  # noqa: E402
from bytecodes import count_step  # noqa: E402

from recorder.compat import dynamo_disabled  # noqa: E402


def _noop(*args) -> None:
    return None


def cold_and_warm(trainer: O.Trainer, batch, fn, rounds: int) -> tuple[float, float]:
    """Median us of ``fn()`` right after a training step and right after itself."""
    fn()
    cold, warm = [], []
    for _ in range(rounds):
        trainer.step(*batch)
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        fn()
        t2 = time.perf_counter_ns()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return statistics.median(cold) / 1e3, statistics.median(warm) / 1e3


def opcodes_per_step(trainer: O.Trainer, batch, files: tuple[str, ...]) -> int:
    """Python opcodes one step executes in files whose path contains one of ``files``."""
    counts = count_step(trainer, *batch)
    return sum(n for (path, _), n in counts.items() if any(f in path for f in files))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=sorted(O.SPECS))
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec, cpu = O.SPECS[args.model], torch.device("cpu")
    batch = spec.make_batch(torch.Generator().manual_seed(1), cpu)
    tmp = tempfile.mkdtemp()
    bare = O.Trainer(spec, cpu, tmp)
    small, zeros, out = torch.randn(1000), torch.zeros(1000), torch.zeros(())
    pair = torch.zeros(2).unbind(0)
    gen = torch.default_generator
    calls = {
        "a Python function that returns None": lambda: None,
        "torch.default_generator.get_state()": gen.get_state,
        "torch.dot (1000 elements, out=) + .item()":
            lambda: (torch.dot(small, zeros, out=out), out.item()),
        "torch.cat of one 1000-element tensor (out=)": lambda: torch.cat([small], out=zeros),
        "torch.aminmax (100 elements, out=)": lambda: torch.aminmax(small[:100], out=pair),
        # the wrapper of the five hooks a step that dynamo must run, not trace
        "a no-op hook under torch.compiler.disable": partial(torch.compiler.disable(_noop), 0),
        "a no-op hook under recorder's dynamo_disabled": partial(dynamo_disabled(_noop), 0),
    }
    print(f"model {args.model}, {args.rounds} rounds; us, median")
    print(f"{'call':48s} {'after a step':>12s} {'after itself':>12s}")
    for name, fn in calls.items():
        c, w = cold_and_warm(bare, batch, fn, args.rounds)
        print(f"{name:48s} {c:12.2f} {w:12.2f}")
    floor, rec = O.Floor(spec, cpu, tmp), O.Recorder(spec, cpu, tmp)
    for t in (floor, rec):
        for _ in range(3):
            t.step(*batch)
    own = ("/recorder/", "/benchmarks/overhead.py")
    print(f"opcodes per step in recorder/ and overhead.py: floor "
          f"{opcodes_per_step(floor, batch, own)}, recorder {opcodes_per_step(rec, batch, own)}")
    rec.close()
    floor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
