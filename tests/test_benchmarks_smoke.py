"""Smoke tests of the benchmark scripts: they run and print their tables (no timing checks)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n" \
                                 f"stderr:\n{proc.stderr}"
    return proc


def test_overhead_quick_mlp(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--models", "mlp", "--json", str(out)])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| mlp |")]
    names = [line.split("|")[2].strip() for line in rows]
    expected = ["bare", "hooks", "anomaly", "recorder"]
    if importlib.util.find_spec("transformers") is not None:
        expected.insert(3, "debug_uo")
    assert names == expected, proc.stdout
    assert "| detector | mlp |" in proc.stdout
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert res["model"] == "mlp"
    assert set(res["detectors"]) == set(expected)
    assert res["detectors"]["bare"]["median_ratio"] == 1.0
    # bare reads no tensor value on the host; the recorder reads one flag per step
    assert res["detectors"]["bare"]["host_reads_per_step"] == 0
    assert res["detectors"]["recorder"]["host_reads_per_step"] >= 1


def test_overhead_in_several_processes(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--models", "mlp", "--detectors",
                 "recorder", "--processes", "2", "--json", str(out)], timeout=240)
    assert "| model | detector | median step (ms) | ratio to bare (median) | ratio range over " \
           "processes |" in proc.stdout
    (res,) = json.loads(out.read_text())["results"]
    rec = res["detectors"]["recorder"]
    assert res["processes"] == 2 and len(rec["process_ratios"]) == 2
    assert rec["ratio_q1"] == min(rec["process_ratios"]) <= rec["median_ratio"] \
        <= max(rec["process_ratios"]) == rec["ratio_q3"]
    assert rec["host_reads_per_step"] >= 1


def test_overhead_floor_yardstick_runs_only_when_named(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--models", "mlp", "--detectors",
                 "recorder,floor", "--json", str(out)])
    (res,) = json.loads(out.read_text())["results"]
    assert list(res["detectors"]) == ["bare", "recorder", "floor"]
    # the yardstick checks its step with one read too, and is not counted as a detector
    assert res["detectors"]["floor"]["host_reads_per_step"] == 1
    assert "- mlp: floor (the statistics' device work alone, bare hooks)" in proc.stdout
    assert "NOT cheaper than floor" not in proc.stdout


def test_overhead_compiled_runs_bare_and_recorder_only(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--compile", "--models", "mlp",
                 "--json", str(out)], timeout=300)
    (res,) = json.loads(out.read_text())["results"]
    assert res["compiled"] is True and list(res["detectors"]) == ["bare", "recorder"]
    assert res["detectors"]["recorder"]["host_reads_per_step"] == 1
    assert "every model torch.compile'd" in proc.stdout


def test_bundle_io_small(tmp_path):
    out = tmp_path / "bundle.json"
    proc = _run([str(BENCH / "bundle_io.py"), "--params", "200000", "--repeats", "1",
                 "--out-dir", str(tmp_path), "--json", str(out)])
    ops = [line.split("|")[2].strip() for line in proc.stdout.splitlines()
           if line.startswith("| level=")]
    assert ops == ["write", "read (streamed)", "read_bundle (whole)"], proc.stdout
    data = json.loads(out.read_text())
    (cfg,) = data["configs"]
    assert cfg["write"]["mb_per_s"] > 0 and cfg["compressed_mb"] > 0
    assert 150_000 < data["params"] < 250_000
    assert not list(tmp_path.glob("nanreplay-bundle-io-*")), "temp dir left behind"
