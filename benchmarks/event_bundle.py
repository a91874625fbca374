#!/usr/bin/env python
"""The bundle a real event writes for a large model, and the replay that reads it back.

A stack of ``--layers`` square ``nn.Linear`` + ReLU layers of about ``--params`` parameters
(several sizes, comma-separated), trained with Adam under ``FlightRecorder``; a NaN is put in
the batch of step ``--bad-step``, so the recorder writes a bundle with weights, gradients and
Adam state at that step and raises ``NonFiniteError``. Per size:

- write: wall time of ``recorder.bundle.write_bundle`` inside the event (compression, fsync and
  link included) and its peak extra resident memory over the RSS just before it (sampled every
  ~2 ms, as in ``bundle_io.py``): near 0 when the writer streams, the tensor data when it holds
  a second copy of it;
- event: the wall time of the event's step (its forward, finding the offender, building and
  writing the bundle) and its peak RSS over the healthy steps' highest peak;
- the bundle's size and its tensor data;
- ``nanreplay --info`` and, with ``--replay``, a full ``nanreplay --json`` of the bundle: wall
  time and the child process's peak RSS (``ru_maxrss``), against the model's own bytes.

    python benchmarks/event_bundle.py [--params 50e6,300e6] [--replay] [--out-dir DIR]
                                      [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bundle_io import MB, PeakRSS  # noqa: E402

from recorder import FlightRecorder, NonFiniteError, bundle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_model(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class _TimedWrite:
    """Wraps ``bundle.write_bundle`` in this process: its wall time and peak extra RSS."""

    def __enter__(self):
        self.orig, self.rows = bundle.write_bundle, []

        def timed(*args, **kwargs):
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                path = self.orig(*args, **kwargs)
                dt = time.perf_counter() - t0
            self.rows.append((dt, mem.extra, mem.hwm_extra))
            return path

        bundle.write_bundle = timed
        return self

    def __exit__(self, *exc):
        bundle.write_bundle = self.orig


def record_event(params: float, layers: int, bad_step: int, out_dir: Path) -> dict:
    width = int((params / layers) ** 0.5)
    torch.manual_seed(0)
    model = make_model(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    crit = nn.MSELoss()
    nparams = sum(p.numel() for p in model.parameters())
    model_bytes = nparams * 4
    res = {"params": nparams, "width": width, "layers": layers, "model_mb": model_bytes / MB}
    print(f"{nparams / 1e6:.0f}M parameters (width {width}, {layers} layers)", file=sys.stderr,
          flush=True)
    step_times, step_peaks = [], []
    with _TimedWrite() as tw:
        try:
            with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir):
                for step in range(bad_step + 1):
                    x, y = torch.randn(4, width), torch.randn(4, width)
                    if step == bad_step:
                        x[1, 0] = float("nan")
                    with PeakRSS() as mem:
                        t0 = time.perf_counter()
                        opt.zero_grad()
                        crit(model(x), y).backward()
                        opt.step()
                        step_times.append(time.perf_counter() - t0)
                    step_peaks.append(mem.peak)
            raise SystemExit("event_bundle: the planted NaN raised no NonFiniteError")
        except NonFiniteError as e:
            dt = time.perf_counter() - t0
            path = Path(e.bundle_path)
    # the event's step against the healthy steps' own peaks (each step frees and remakes the
    # gradients, so the RSS just before a step is no baseline)
    healthy = max(step_peaks[1:])
    res.update({"step_s": min(step_times[1:]), "event_s": dt,
                "event_extra_mb": max(0, mem.peak - healthy) / MB,
                "healthy_step_peak_mb": healthy / MB, "event_step_peak_mb": mem.peak / MB})
    w = tw.rows[-1]
    res.update({"write_s": w[0], "write_extra_mb": w[1] / MB,
                "write_hwm_extra_mb": None if w[2] is None else w[2] / MB,
                "bundle_mb": path.stat().st_size / MB, "path": str(path)})
    with bundle.BundleReader(path) as r:
        res["tensor_mb"] = sum(n for _, _, _, n in r.entries) / MB
    del model, opt
    return res


def child(args: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, peak RSS (MB), exit code and last output line of a child process. The
    peak is GNU time's (a child forked from this process would inherit its ``ru_maxrss``)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-o", rss.name, "-f", "%M"] + args, cwd=ROOT,
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        dt = time.perf_counter() - t0
        peak = int(rss.read().strip().splitlines()[-1]) * 1024 / MB
    last = ((p.stdout + p.stderr).strip().splitlines() or [""])[-1]
    return dt, peak, p.returncode, last[:200]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="50e6,300e6")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--bad-step", type=int, default=3)
    ap.add_argument("--replay", action="store_true", help="also run a full replay")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    rows = []
    cli = [sys.executable, "-c", "from replay.cli import main; main()"]
    with tempfile.TemporaryDirectory(prefix="nanreplay-event-", dir=args.out_dir) as tmp:
        for params in (float(s) for s in args.params.split(",")):
            r = record_event(params, args.layers, args.bad_step, Path(tmp))
            r["info_s"], r["info_rss_mb"], rc, _ = child(cli + ["--info", r["path"]])
            assert rc == 0, f"--info exited {rc}"
            if args.replay:
                r["replay_s"], r["replay_rss_mb"], r["replay_rc"], r["replay_last"] = child(
                    cli + ["--json", r["path"]])
            print(json.dumps(r), file=sys.stderr, flush=True)
            Path(r["path"]).unlink()
            rows.append(r)
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def render(rows: list[dict]) -> str:
    out = ["| params | model MB | tensor data MB | bundle MB | step s | event s | write s "
           "| write peak extra MB | event step peak over healthy steps MB | --info s | --info peak RSS MB "
           "| replay s | replay peak RSS MB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rep = (f"{r['replay_s']:.1f} | {r['replay_rss_mb']:.0f}" if "replay_s" in r
               else "- | -")
        out.append(f"| {r['params'] / 1e6:.0f}M | {r['model_mb']:.0f} | {r['tensor_mb']:.0f} "
                   f"| {r['bundle_mb']:.0f} | {r['step_s']:.2f} | {r['event_s']:.1f} "
                   f"| {r['write_s']:.1f} | {r['write_extra_mb']:.0f} "
                   f"| {r['event_extra_mb']:.0f} | {r['info_s']:.1f} | {r['info_rss_mb']:.0f} "
                   f"| {rep} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
