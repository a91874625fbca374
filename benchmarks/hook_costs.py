"""Where the recorder's distance to the floor goes, hook by hook: the time a real training step
spends inside each kind of hook (the root's pre-hook, the leaves', the root's post-hook, the
loss's, the optimizer's step pre- and post-hooks) for ``bare``, ``floor`` and ``recorder``
copies of a benchmark model, rounds interleaved, medians, and recorder − floor paired per round.

    python benchmarks/hook_costs.py [--model mlp] [--rounds 400]

Each part is timed by two hooks of this script's around the detector's own: one put first
(``prepend=True``; for the optimizer, moved to the front of its hook dict) and one put last. So
a part includes the detector's hook wrappers, and the step's other time (kernels, autograd,
the interpreter between hooks) is what ``all`` has beyond the parts. Noisy on a shared machine,
like every timing here; it says which hook to look at, ``overhead.py`` says how far it is.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import overhead as O  # noqa: E402

PARTS = ("root_pre", "leaf_pre", "leaf_post", "root_post", "loss_post", "opt_pre", "opt_post")


class Timed:
    """Time spent inside each kind of hook during one step of ``trainer``."""

    def __init__(self, trainer: O.Trainer):
        self.spent: collections.Counter = collections.Counter()
        self._started: dict = {}
        model = trainer.model
        leaves = [m for m in model.modules() if next(m.children(), None) is None]
        for kind, modules in (("root", [model]), ("leaf", leaves), ("loss", [trainer.crit])):
            for m in modules:
                m.register_forward_pre_hook(self._begin(kind + "_pre"), prepend=True)
                m.register_forward_pre_hook(self._end(kind + "_pre"))
                m.register_forward_hook(self._begin(kind + "_post"), prepend=True)
                m.register_forward_hook(self._end(kind + "_post"))
        opt = trainer.opt
        for kind, register, hooks in (
                ("opt_pre", opt.register_step_pre_hook, opt._optimizer_step_pre_hooks),
                ("opt_post", opt.register_step_post_hook, opt._optimizer_step_post_hooks)):
            first = register(self._begin(kind))
            hooks.move_to_end(first.id, last=False)
            register(self._end(kind))

    def _begin(self, kind: str):
        def hook(*args):
            self._started[kind] = time.perf_counter_ns()
        return hook

    def _end(self, kind: str):
        def hook(*args):
            self.spent[kind] += time.perf_counter_ns() - self._started[kind]
        return hook


def measure(model: str, rounds: int, warmup: int = 10) -> dict[str, dict[str, list[int]]]:
    """ns per step, per copy and part (``all``: the whole step)."""
    spec, cpu = O.SPECS[model], torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    batches = [spec.make_batch(g, cpu) for _ in range(4)]
    tmp = tempfile.mkdtemp()
    copies = {c.name: c(spec, cpu, tmp) for c in (O.Trainer, O.Floor, O.Recorder)}
    timed = {name: Timed(t) for name, t in copies.items()}
    times: dict = {name: collections.defaultdict(list) for name in copies}
    names = list(copies)
    for r in range(rounds + warmup):
        batch = batches[r % len(batches)]
        for name in names[r % 3:] + names[:r % 3]:
            timed[name].spent.clear()
            t0 = time.perf_counter_ns()
            copies[name].step(*batch)
            t1 = time.perf_counter_ns()
            if r >= warmup:
                times[name]["all"].append(t1 - t0)
                for part in PARTS:
                    times[name][part].append(timed[name].spent[part])
    for t in copies.values():
        t.close()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=sorted(O.SPECS))
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    times = measure(args.model, args.rounds)
    names = list(times)
    print(f"model {args.model}, {args.rounds} rounds; us per step, median")
    print(f"{'part':10s} " + " ".join(f"{n:>9s}" for n in names) + "  recorder - floor (paired)")
    for part in (*PARTS, "all"):
        paired = [a - b for a, b in zip(times["recorder"][part], times["floor"][part])]
        print(f"{part:10s} " + " ".join(f"{statistics.median(times[n][part]) / 1e3:9.1f}"
                                          for n in names)
              + f"  {statistics.median(paired) / 1e3:+9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
