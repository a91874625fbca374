#!/usr/bin/env python
"""Write and read speed, size and peak extra memory of a ``.nan`` bundle.

Builds a model of ``--params`` parameters (a stack of square Linear layers, 100M by default)
with Adam state (one optimizer step on random gradients, so ``exp_avg``/``exp_avg_sq`` exist),
then writes weights + optimizer state with ``recorder.bundle.write_bundle`` and reads them back,
``--repeats`` times each (medians reported):

- write: ``write_bundle(out_dir, stem, meta, tensors)`` (compression, fsync and link included);
- read (streamed): ``BundleReader(path).tensors()``, each tensor dropped once decompressed, the
  way a replayer that loads into an existing model consumes it;
- read (whole): ``read_bundle(path)``, which returns every tensor at once, so its extra memory is
  the tensor data itself by design.

Speed is bytes of tensor data / wall seconds. Peak extra memory is the highest resident set size
seen by a thread that reads ``/proc/self/statm`` every ~2 ms, minus the RSS just before the call
(cross-checked with the kernel's VmHWM, reset through ``/proc/self/clear_refs`` where allowed).
The file is read back right after it was written, so reads come from the page cache.

Targets: write >= 250 MB/s of tensor data, peak extra memory <= 256 MB.

    python benchmarks/bundle_io.py [--params N] [--repeats 3] [--levels default,1]
                                   [--threads -1] [--out-dir DIR] [--json out.json]

``--levels`` and ``--threads`` are for investigating: ``--levels`` passes ``level=`` to
``write_bundle`` (``default`` = its own default), ``--threads`` replaces the ``threads=`` that
``write_bundle`` gives ``zstandard.ZstdCompressor`` (by wrapping the class in this process only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zstandard
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from recorder import bundle  # noqa: E402

WRITE_TARGET_MBS = 250.0
MEMORY_TARGET_MB = 256.0
MB = 1e6  # speeds and sizes in decimal megabytes
_PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------------------------
# memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Samples RSS every ``interval`` seconds in a thread; ``extra`` = peak - RSS at start."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self.hwm_ok = _reset_hwm()
        self.base = _rss()
        self.peak = self.base
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            r = _rss()
            self.samples += 1
            if r > self.peak:
                self.peak = r
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        hwm = _hwm() if self.hwm_ok else None
        self.hwm_extra = None if hwm is None else max(0, hwm - self.base)

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)


# ----------------------------------------------------------------------------------------------
# the state to write


def build_state(params: int, layers: int = 6, seed: int = 0):
    """A stack of ``layers`` square Linear layers holding about ``params`` parameters, with
    Adam state after one step. Returns the tensors a bundle would hold and their byte count."""
    width = max(8, int(math.sqrt(params / layers)))
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        tensors[f"weights/{name}"] = p.detach()
        for k, v in opt.state[p].items():
            tensors[f"optimizer/{name}/{k}"] = v
    model.zero_grad(set_to_none=True)
    nparams = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"benchmark": "bundle_io", "params": nparams, "width": width, "layers": layers}
    return model, opt, tensors, meta, nparams, nbytes


# ----------------------------------------------------------------------------------------------
# zstd threads override (investigation only; recorder/bundle.py is not modified)


class _ThreadsOverride:
    def __init__(self, threads: int | None):
        self.threads = threads

    def __enter__(self):
        self.orig = zstandard.ZstdCompressor
        if self.threads is None:
            return self
        orig, threads = self.orig, self.threads

        def compressor(*args, **kwargs):
            kwargs["threads"] = threads
            return orig(*args, **kwargs)

        zstandard.ZstdCompressor = compressor
        return self

    def __exit__(self, *exc):
        zstandard.ZstdCompressor = self.orig


# ----------------------------------------------------------------------------------------------
# measurement


def run_config(tensors, meta, nbytes: int, out_dir: Path, level: int | None,
               threads: int | None, repeats: int) -> dict:
    label = f"level={'default' if level is None else level}, " \
            f"threads={'default' if threads is None else threads}"
    kw = {} if level is None else {"level": level}
    writes, reads, wholes = [], [], []
    size = None
    for i in range(repeats):
        stem = f"bench-{os.getpid()}-{i}"
        with _ThreadsOverride(threads), PeakRSS() as mem:
            t0 = time.perf_counter()
            path = bundle.write_bundle(out_dir, stem, meta, tensors, **kw)
            dt = time.perf_counter() - t0
        size = path.stat().st_size
        writes.append((dt, mem.extra, mem.hwm_extra, mem.samples))
        print(f"  [{label}] write {i + 1}/{repeats}: {nbytes / MB / dt:.0f} MB/s, "
              f"extra {mem.extra / MB:.0f} MB", file=sys.stderr, flush=True)

        with PeakRSS() as mem:
            t0 = time.perf_counter()
            got = 0
            with bundle.BundleReader(path) as r:
                for _, t in r.tensors():
                    got += t.numel() * t.element_size()
                    del t
            dt = time.perf_counter() - t0
        assert got == nbytes, (got, nbytes)
        reads.append((dt, mem.extra, mem.hwm_extra, mem.samples))

        with PeakRSS() as mem:
            t0 = time.perf_counter()
            _, back = bundle.read_bundle(path)
            dt = time.perf_counter() - t0
        ok = all(torch.equal(back[k], v) for k, v in tensors.items()) if i == 0 else True
        if not ok:
            raise SystemExit("bundle_io: read back tensors differ from those written")
        del back
        wholes.append((dt, mem.extra, mem.hwm_extra, mem.samples))
        print(f"  [{label}] read {i + 1}/{repeats}: streamed {nbytes / MB / reads[-1][0]:.0f} "
              f"MB/s (extra {reads[-1][1] / MB:.0f} MB), whole {nbytes / MB / dt:.0f} MB/s "
              f"(extra {mem.extra / MB:.0f} MB)", file=sys.stderr, flush=True)
        path.unlink()

    def summarize(rows):
        secs = statistics.median(r[0] for r in rows)
        hwms = [r[2] for r in rows if r[2] is not None]
        return {"seconds": secs, "mb_per_s": nbytes / MB / secs,
                "peak_extra_mb": statistics.median(r[1] for r in rows) / MB,
                "peak_extra_mb_max": max(r[1] for r in rows) / MB,
                "hwm_extra_mb": statistics.median(hwms) / MB if hwms else None,
                "samples": statistics.median(r[3] for r in rows)}

    return {"level": level, "threads": threads, "label": label,
            "compressed_mb": size / MB, "ratio": nbytes / size,
            "write": summarize(writes), "read_streamed": summarize(reads),
            "read_whole": summarize(wholes)}


def render(res: dict) -> str:
    lines = [f"Bundle I/O: {res['params'] / 1e6:.1f}M parameters + Adam state = "
             f"{res['tensor_mb']:.0f} MB of tensor data ({res['tensors']} tensors), "
             f"{res['repeats']} repeats, medians", "",
             "| config | operation | MB/s | seconds | peak extra MB (sampled) | peak extra MB (VmHWM) "
             "| compressed MB | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in res["configs"]:
        for op, key in (("write", "write"), ("read (streamed)", "read_streamed"),
                        ("read_bundle (whole)", "read_whole")):
            s = c[key]
            hwm = "-" if s["hwm_extra_mb"] is None else f"{s['hwm_extra_mb']:.0f}"
            size = f"{c['compressed_mb']:.0f} | {c['ratio']:.3f}" if op == "write" else " | "
            lines.append(f"| {c['label']} | {op} | {s['mb_per_s']:.0f} | {s['seconds']:.2f} "
                         f"| {s['peak_extra_mb']:.0f} | {hwm} | {size} |")
    return "\n".join(lines)


def verdicts(res: dict) -> list[str]:
    out = []
    for c in res["configs"]:
        w = c["write"]
        ok = w["mb_per_s"] >= WRITE_TARGET_MBS
        out.append(f"- [{c['label']}] write {w['mb_per_s']:.0f} MB/s, target >= "
                   f"{WRITE_TARGET_MBS:.0f} MB/s: {'met' if ok else 'MISSED'}")
        for name, key in (("write", "write"), ("streamed read", "read_streamed")):
            m = c[key]["peak_extra_mb"]
            ok = m <= MEMORY_TARGET_MB
            out.append(f"- [{c['label']}] {name} peak extra memory {m:.0f} MB, target <= "
                       f"{MEMORY_TARGET_MB:.0f} MB: {'met' if ok else 'MISSED'}")
        m = c["read_whole"]["peak_extra_mb"]
        out.append(f"- [{c['label']}] read_bundle (whole) peak extra memory {m:.0f} MB: it "
                   f"returns all {res['tensor_mb']:.0f} MB of tensors, so this is the result "
                   "itself, not a target")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6,
                    help="model parameters (default 100e6; Adam state triples the data)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="default",
                    help="comma-separated zstd levels to try ('default' = write_bundle's own)")
    ap.add_argument("--threads", default="default",
                    help="comma-separated zstd threads values to try ('default' = write_bundle's "
                    "own, -1 = all cores, 0 = single-threaded in the caller)")
    ap.add_argument("--out-dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = ap.parse_args(argv)

    levels = [None if s.strip() == "default" else int(s) for s in args.levels.split(",")]
    threads = [None if s.strip() == "default" else int(s) for s in args.threads.split(",")]

    print(f"building a {args.params / 1e6:g}M-parameter model with Adam state...",
          file=sys.stderr, flush=True)
    model, opt, tensors, meta, nparams, nbytes = build_state(int(args.params))
    res = {"params": nparams, "tensor_mb": nbytes / MB, "tensors": len(tensors),
           "repeats": args.repeats, "configs": [],
           "machine": {"cpu": _cpu_name(), "cpu_count": os.cpu_count(),
                       "torch": torch.__version__, "zstandard": zstandard.__version__,
                       "python": platform.python_version(),
                       "recorder_commit": _recorder_commit(),
                       "date": datetime.datetime.now(datetime.timezone.utc)
                       .strftime("%Y-%m-%d %H:%M UTC")}}
    with tempfile.TemporaryDirectory(prefix="nanreplay-bundle-io-",
                                     dir=args.out_dir) as tmp:
        res["out_dir_fs"] = _fs_type(Path(tmp))
        for level in levels:
            for th in threads:
                res["configs"].append(run_config(tensors, meta, nbytes, Path(tmp), level, th,
                                                 args.repeats))

    print(render(res))
    print()
    print("Targets:")
    for v in verdicts(res):
        print(v)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _recorder_commit() -> str | None:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", "recorder/bundle.py"],
                             cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev or None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fs_type(path: Path) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts), for the report."""
    best, fs = "", "unknown"
    try:
        real = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and real.startswith(parts[1]) and len(parts[1]) > len(best):
                    best, fs = parts[1], parts[2]
    except OSError:
        pass
    return fs


if __name__ == "__main__":
    sys.exit(main())
