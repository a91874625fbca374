"""Python bytecodes a detector runs per training step: its bookkeeping, counted, not timed.

On a small CPU model the recorder's distance to the ``floor`` (``overhead.py``) is its Python
bookkeeping, and that distance (a few hundred µs) is below what timing resolves on a shared
machine from one change to the next. The number of bytecodes the interpreter executes in a step
is exact and the same on every run, so it tells whether a change to the hot path added or removed
work, and where the work is (per function). It is not a time: a bytecode after the model's
kernels costs its cache misses too (``docs/benchmarks.md`` has the measured step times).

Each detector's copy of the model trains ``--warmup`` steps (past CPython's specialisation of
the code that runs once a step), then one step is traced with ``sys.settrace`` and opcode
events. Run from the repository root::

    python benchmarks/bytecodes.py                       # mlp, cnn, transformer: ~1 minute
    python benchmarks/bytecodes.py --models mlp --top 20 # the recorder's costliest functions
    python benchmarks/bytecodes.py --baseline ../main    # before/after: another recorder/
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import overhead  # noqa: E402  (the benchmark models and detectors)

MODELS = ("mlp", "cnn", "transformer")
DETECTORS = ("bare", "floor", "recorder")
# recorder - floor, bytecodes per step (e69152b: mlp 4973, cnn 21018, transformer 21696; with
# the small parameters' norms in C loops: 4815, 10615, 13179; the large ones' told by C loops
# too: 4590, 10570, 12139; every RNG fingerprint in one function: 4423, 10403, 11990; stop 44:
# 4162, 10142, 11724, its frame-saving inlines undone, as they saved no time) plus about a
# tenth: a change that adds per-step Python beyond it says why and raises it
RATCHET = {"mlp": 4600, "cnn": 11150, "transformer": 12900}


def count_step(trainer, x, y) -> collections.Counter:
    """Bytecodes executed in one ``trainer.step``, per ``(file, function)``."""
    counts: collections.Counter = collections.Counter()

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        return trace

    sys.settrace(trace)
    try:
        trainer.step(x, y)
    finally:
        sys.settrace(None)
    return counts


def own_part(counts: collections.Counter, dirs: tuple[str, ...]) -> dict[str, int]:
    """The bytecodes run in files under ``dirs`` (a recorder's package), per ``module.function``."""
    out: dict[str, int] = {}
    for (path, fn), n in counts.items():
        if path.startswith(dirs):
            key = f"{Path(path).stem}.{fn}"
            out[key] = out.get(key, 0) + n
    return out


def measure(model: str, detectors: list[str], warmup: int, baseline: str | None) -> dict:
    spec = overhead.SPECS[model]
    g = torch.Generator().manual_seed(1)
    x, y = spec.make_batch(g, torch.device("cpu"))
    result: dict = {"model": model, "detectors": {}}
    tmp = tempfile.mkdtemp(prefix="nanreplay-bytecodes-")
    for name in detectors:
        trainer = overhead.TRAINERS[name](spec, torch.device("cpu"), tmp)
        try:
            for _ in range(warmup):
                trainer.step(x, y)
            counts = count_step(trainer, x, y)
        finally:
            trainer.close()
        pkg = Path(baseline if name == "recorder_base" else ROOT) / "recorder"
        own = own_part(counts, (str(pkg.resolve()) + os.sep,))
        result["detectors"][name] = {"bytecodes": sum(counts.values()),
                                     "own": sum(own.values()), "functions": own}
    rows = result["detectors"]
    for name, row in rows.items():
        if name != "bare":
            row["minus_bare"] = row["bytecodes"] - rows["bare"]["bytecodes"]
        if "floor" in rows and name not in ("bare", "floor"):
            row["minus_floor"] = row["bytecodes"] - rows["floor"]["bytecodes"]
    return result


def render(results: list[dict], top: int) -> str:
    out = ["| model | detector | bytecodes/step | − bare | − floor | in recorder/ |",
           "|---|---|---:|---:|---:|---:|"]
    for res in results:
        for name, row in res["detectors"].items():
            out.append(f"| {res['model']} | {name} | {row['bytecodes']} | "
                       f"{row.get('minus_bare', '')} | {row.get('minus_floor', '')} | "
                       f"{row['own'] if name.startswith('recorder') else ''} |")
    for res in results:
        rec = res["detectors"].get("recorder")
        if top and rec:
            out += ["", f"{res['model']}: the recorder's {top} costliest functions "
                    "(bytecodes/step)", ""]
            for fn, n in sorted(rec["functions"].items(), key=lambda kv: -kv[1])[:top]:
                out.append(f"- {n:6d}  {fn}")
    return "\n".join(out)


def verdicts(results: list[dict]) -> list[str]:
    lines = []
    for res in results:
        rec = res["detectors"].get("recorder", {})
        cap = RATCHET.get(res["model"])
        if "minus_floor" in rec and cap is not None:
            ok = "within" if rec["minus_floor"] <= cap else "OVER"
            lines.append(f"- {res['model']}: recorder − floor {rec['minus_floor']} bytecodes "
                         f"per step, ratchet {cap}: {ok}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated subset of: " + ", ".join(overhead.SPECS))
    ap.add_argument("--warmup", type=int, default=20, help="untraced steps first (default 20)")
    ap.add_argument("--top", type=int, default=0, help="list the recorder's N costliest functions")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also count the recorder of another checkout (its recorder/ package) "
                    "as detector recorder_base")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in overhead.SPECS]
    if bad:
        ap.error(f"unknown model(s) {bad}; choose from {', '.join(overhead.SPECS)}")
    detectors = list(DETECTORS)
    if args.baseline:
        overhead.TRAINERS["recorder_base"] = overhead.baseline_trainer(args.baseline)
        detectors.append("recorder_base")
    torch.set_num_threads(1)  # (the count does not depend on it; the run is shorter)
    results = []
    for m in models:
        print(f"{m}: counting {', '.join(detectors)}", file=sys.stderr)
        results.append(measure(m, detectors, args.warmup, args.baseline))
    print(render(results, args.top))
    lines = verdicts(results)
    if lines:
        print("\nRatchet:\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
