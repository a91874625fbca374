"""Smoke tests of the benchmark scripts: they run, print their tables, count what they claim to
count, and print verdicts that follow from their own numbers (no timing checks: ``--quick``
measures nothing, so each verdict is recomputed here from the JSON, whichever way it went)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _overhead_module():
    spec = importlib.util.spec_from_file_location("overhead_bench", BENCH / "overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


overhead = _overhead_module()
TARGET = overhead.RATIO_TARGET
FLOOR_GAP = overhead.FLOOR_GAP_TARGET
# the usual recipe reads two flags per module output (isnan(...).any(), isinf(...).any()) and
# one for the gradient norm: counted from the benchmark's own MLP, not taken from its output
HOOK_READS_MLP = 2 * len(list(overhead.MLP().modules())) + 1


def verdict_lines(stdout: str) -> list[str]:
    return stdout.split("\nTargets:\n", 1)[1].strip().splitlines()


def expected_verdicts(res: dict) -> list[tuple[str, str]]:
    """``(pattern, expected outcome)`` per verdict line of one model, from its JSON numbers."""
    m, rows = re.escape(res["model"]), res["detectors"]
    rec = rows["recorder"]["median_ratio"]
    out = [(rf"- {m}: FlightRecorder {rec:.3f}x bare, target <= {TARGET}x: (met|MISSED)",
            "met" if rec <= TARGET else "MISSED")]
    others = {n: r["median_ratio"] for n, r in rows.items()
              if n not in ("bare", "recorder", "floor", "recorder_base")}
    if others:
        worse = ", ".join(n for n, v in others.items() if v <= rec)
        out.append((rf"- {m}: FlightRecorder is (NOT cheaper than [a-z_, ]+|cheaper than every "
                     r"other detector) \(.*\)",
                     f"NOT cheaper than {worse}" if worse
                     else "cheaper than every other detector"))
    if "floor" in rows:
        floor = rows["floor"]["median_ratio"]
        gap = round((rec - floor) * 100, 1) + 0.0
        out.append((rf"- {m}: floor \(the statistics' device work alone, bare hooks\) "
                    rf"{floor:.3f}x bare, target <= {TARGET}x (within reach|out of reach) for a "
                    rf"recorder on module hooks; recorder minus floor: {re.escape(f'{gap:+.1f}')}%"
                    r" of a bare step .*",
                    "within reach" if floor <= TARGET else "out of reach"))
    if "floor" in rows and "minus_floor" in rows["recorder"]:
        # the same distance paired round by round, judged against the 0.02 target
        paired = rows["recorder"]["minus_floor"]
        q1, q3 = rows["recorder"]["minus_floor_q1"], rows["recorder"]["minus_floor_q3"]
        assert q1 <= paired <= q3
        out.append((rf"- {m}: recorder minus floor, paired round by round: "
                    rf"{re.escape(f'{paired:+.3f}')} of a bare step \(IQR "
                    rf"{re.escape(f'{q1:+.3f}')} to {re.escape(f'{q3:+.3f}')}\), target <= "
                    rf"{FLOOR_GAP}: (met|MISSED)", "met" if paired <= FLOOR_GAP else "MISSED"))
    if "floor" in rows and "cpu_minus_floor" in rows["recorder"]:
        # the same in the thread's CPU time (CPU runs): no target of its own
        cpu = rows["recorder"]["cpu_minus_floor"]
        q1, q3 = rows["recorder"]["cpu_minus_floor_q1"], rows["recorder"]["cpu_minus_floor_q3"]
        assert q1 <= cpu <= q3
        out.append((rf"- {m}: the same in the thread's CPU time: ({re.escape(f'{cpu:+.3f}')}) "
                    rf"of a bare step \(IQR {re.escape(f'{q1:+.3f}')} to "
                    rf"{re.escape(f'{q3:+.3f}')}\)", f"{cpu:+.3f}"))
    reads = rows["recorder"]["host_reads_per_step"]
    out.append((rf"- {m}: FlightRecorder host reads/step = {reads:g}, budget 1: (met|MISSED)",
                "met" if reads == 1 else "MISSED"))
    return out


def check_verdicts(stdout: str, results: list[dict]) -> None:
    """Every verdict line is there, in order, and says what the numbers say."""
    lines = verdict_lines(stdout)
    expected = [e for res in results for e in expected_verdicts(res)]
    assert len(lines) == len(expected), lines
    for line, (pattern, outcome) in zip(lines, expected):
        match = re.fullmatch(pattern, line)
        assert match, (line, pattern)
        assert match.group(1) == outcome, line


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
    reads = {n: d["host_reads_per_step"] for n, d in res["detectors"].items()}
    # bare and anomaly mode read no tensor value from Python; the recorder reads one flag per
    # step; the hook recipe two per module output and one for the norm (the counter counts)
    assert (reads["bare"], reads["anomaly"], reads["recorder"]) == (0, 0, 1), reads
    assert reads["hooks"] == HOOK_READS_MLP, reads
    if "debug_uo" in reads:
        assert reads["debug_uo"] > HOOK_READS_MLP, reads  # it reads every tensor's stats
    check_verdicts(proc.stdout, data["results"])


def test_cold_cost_prints_both_timings_and_the_opcode_counts():
    proc = _run([str(BENCH / "cold_cost.py"), "--rounds", "3"])
    rows = [line for line in proc.stdout.splitlines() if re.search(r"\d+\.\d\d +\d+\.\d\d$", line)]
    assert len(rows) == 7, proc.stdout
    m = re.search(r"floor (\d+), recorder (\d+)", proc.stdout)
    # the recorder's bookkeeping runs in its own code; the floor's few hooks in overhead.py
    assert m and 0 < int(m[1]) < int(m[2]), proc.stdout


def test_hook_costs_time_every_part_around_the_detectors_own_hooks(tmp_path):
    proc = _run([str(BENCH / "hook_costs.py"), "--rounds", "3"])
    parts = [line.split()[0] for line in proc.stdout.splitlines()
             if re.fullmatch(r"\w+( +\S+){4}", line) and not line.startswith("part")]
    assert parts == ["root_pre", "leaf_pre", "leaf_post", "root_post", "loss_post", "opt_pre",
                     "opt_post", "all"], proc.stdout
    # what makes a part the detector's: its timers are the first and the last hook of each kind
    spec = importlib.util.spec_from_file_location("hook_costs_bench", BENCH / "hook_costs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rec = mod.O.Recorder(mod.O.SPECS["mlp"], torch.device("cpu"), str(tmp_path))
    own = (list(rec.model._forward_pre_hooks.values()),
           list(rec.opt._optimizer_step_pre_hooks.values()),
           list(rec.opt._optimizer_step_post_hooks.values()))
    mod.Timed(rec)
    for before, hooks in zip(own, (rec.model._forward_pre_hooks, rec.opt._optimizer_step_pre_hooks,
                                   rec.opt._optimizer_step_post_hooks)):
        first, *middle, last = hooks.values()
        assert before and middle == before
        assert first.__qualname__.startswith("Timed._begin"), first
        assert last.__qualname__.startswith("Timed._end"), last
    rec.close()


def test_overhead_bookkeeping_model_is_opt_in(tmp_path):
    """``--models mlp16`` (the MLP at width 16, batch 4: a step of Python) runs beside the
    floor; it is not among the default models."""
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--models", "mlp16", "--detectors",
                 "recorder,floor", "--json", str(out)])
    (res,) = json.loads(out.read_text())["results"]
    assert res["model"] == "mlp16" and "width 16, batch 4" in res["description"]
    reads = {n: d["host_reads_per_step"] for n, d in res["detectors"].items()}
    assert reads == {"bare": 0, "recorder": 1, "floor": 1}, reads
    assert "| mlp16 | recorder |" in proc.stdout
    assert "mlp16" not in overhead.MODELS


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
    assert rec["host_reads_per_step"] == 1  # the most any process read
    check_verdicts(proc.stdout, [res])


def test_overhead_floor_yardstick_runs_only_when_named(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--models", "mlp", "--detectors",
                 "recorder,floor", "--json", str(out)])
    (res,) = json.loads(out.read_text())["results"]
    assert list(res["detectors"]) == ["bare", "recorder", "floor"]
    # the yardstick checks its step with one read too, and is not counted as a detector: no
    # "cheaper than" line, a floor line judged against the target instead
    assert res["detectors"]["floor"]["host_reads_per_step"] == 1
    assert res["detectors"]["recorder"]["host_reads_per_step"] == 1
    check_verdicts(proc.stdout, [res])
    assert not any("cheaper than" in line for line in verdict_lines(proc.stdout))


def test_overhead_compiled_runs_bare_and_recorder_only(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--quick", "--compile", "--models", "mlp",
                 "--json", str(out)], timeout=300)
    (res,) = json.loads(out.read_text())["results"]
    assert res["compiled"] is True and list(res["detectors"]) == ["bare", "recorder"]
    assert res["detectors"]["recorder"]["host_reads_per_step"] == 1
    assert res["detectors"]["bare"]["host_reads_per_step"] == 0
    assert "every model torch.compile'd" in proc.stdout
    check_verdicts(proc.stdout, [res])


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


def _row(ratio: float, reads: float = 0, syncs: float | None = None) -> dict:
    return {"median_step_ms": 1.0, "median_ratio": ratio, "ratio_q1": ratio, "ratio_q3": ratio,
            "host_reads_per_step": reads, "cuda_sync_warnings_per_step": syncs}


@pytest.mark.parametrize("rec, floor, hooks, reads, gap, outcomes", [
    (1.02, 1.01, 1.30, 1, 0.012,
     ["met", "cheaper than every other detector", "within reach", "met", "met"]),
    (1.08, 1.06, 1.05, 2, 0.021,
     ["MISSED", "NOT cheaper than hooks", "out of reach", "MISSED", "MISSED"]),
    (1.049, 1.051, 1.049, 1, 0.02,
     ["met", "NOT cheaper than hooks", "out of reach", "met", "met"]),
])
def test_verdicts_compare_the_numbers(rec, floor, hooks, reads, gap, outcomes):
    """Both outcomes of every verdict, from numbers on either side of its threshold."""
    recorder = {**_row(rec, reads), "minus_floor": gap, "minus_floor_q1": gap - 0.01,
                "minus_floor_q3": gap + 0.01}
    res = {"model": "mlp", "detectors": {"bare": _row(1.0), "hooks": _row(hooks),
                                         "recorder": recorder, "floor": _row(floor, 1)}}
    lines = overhead.verdicts([res])
    check_verdicts("\nTargets:\n" + "\n".join(lines), [res])
    assert [re.fullmatch(p, line).group(1)
            for line, (p, _) in zip(lines, expected_verdicts(res))] == outcomes
    assert lines[2].endswith("(noise)") == (rec < floor)


def test_verdict_on_cuda_judges_the_sync_warnings():
    res = {"model": "cnn", "detectors": {"bare": _row(1.0),
                                         "recorder": _row(1.01, 1, syncs=3)}}
    assert overhead.verdicts([res])[-1] == ("- cnn: FlightRecorder host reads/step = 1, budget 1: "
                                            "met; CUDA sync warnings/step = 3: MISSED")


def test_replay_time_names_the_planted_origin(tmp_path):
    """``replay_time.py`` records its transformer until the planted masked row fires, replays
    it, and prints the time and the origin; it exits 1 itself when the report is not the
    planted one. Its JSON and its table say the same."""
    out = tmp_path / "replay.json"
    proc = _run([str(BENCH / "replay_time.py"), "--repeats", "1", "--json", str(out)],
                timeout=600)
    data = json.loads(out.read_text())
    o = data["origin"]
    assert (o["module"], o["op"], o["cause"], o["reproduced"]) == \
        ("blocks.0.attn", "aten._softmax", "invalid", True), o
    b = o["bisection"]
    assert b["agrees"] is True and b["limit"] == math.ceil(math.log2(b["calls"])) + 1
    assert 0 < b["probes"] <= b["limit"], b
    assert len(data["replay_s"]) == 1 and data["median_s"] == data["replay_s"][0] > 0
    assert data["replay_in_steps"] == pytest.approx(data["median_s"] / data["train_step_s"])
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 4-layer"))
    assert row.endswith(f"| blocks.0.attn aten._softmax (invalid, bisection {b['probes']} "
                        "probes) |"), row
    assert f"median replay time: {data['median_s']:.2f} s" in proc.stdout


def _bytecodes_module():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bytecodes_bench", BENCH / "bytecodes.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def test_bytecodes_count_each_detector_and_hold_the_recorder_to_its_ratchet(tmp_path):
    """The bytecode count of a step is exact, so this is the one per-step cost a test can hold
    the recorder to: its Python above the floor's on the MLP stays within the ratchet (a change
    that adds per-step work must say why and raise it), and the table says what the JSON
    holds."""
    out = tmp_path / "bytecodes.json"
    proc = _run([str(BENCH / "bytecodes.py"), "--models", "mlp", "--top", "5", "--json",
                 str(out)], timeout=300)
    (res,) = json.loads(out.read_text())
    rows = res["detectors"]
    assert list(rows) == ["bare", "floor", "recorder"]
    rec, floor, bare = rows["recorder"], rows["floor"], rows["bare"]
    assert rec["minus_floor"] == rec["bytecodes"] - floor["bytecodes"]
    assert rec["minus_bare"] == rec["bytecodes"] - bare["bytecodes"]
    assert rec["own"] == sum(rec["functions"].values()) and bare["own"] == 0
    # the hooks the recorder runs are its own: each is counted where it runs
    assert rec["functions"]["calls.leaf_hook"] > 0 and rec["functions"]["cycle.close_tape"] > 0
    cap = _bytecodes_module().RATCHET["mlp"]
    assert f"| mlp | recorder | {rec['bytecodes']} | {rec['minus_bare']} | " \
           f"{rec['minus_floor']} | {rec['own']} |" in proc.stdout
    assert f"- mlp: recorder − floor {rec['minus_floor']} bytecodes per step, ratchet {cap}: " \
           "within" in proc.stdout
    assert rec["minus_floor"] <= cap, rec["minus_floor"]
