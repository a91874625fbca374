"""Golden outputs of the text report and of ``--info``: a change in their shape is a visible diff.

The toy bundle's report is compared line for line (``bundles.TOY_REPORT``); ``--info`` is
compared after giving the bundle a fixed environment (python, torch, argv, commit differ from
machine to machine) and replacing its absolute path by ``<BUNDLE>``. The remaining tests feed
``report.to_text`` hand-made reports to pin each optional line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bundles import EXAMPLES, TOY_REPORT, rewrite
from bundles import invoke_cli as run

from replay.report import to_text


def test_toy_report_golden(toy, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)
    r = run(toy)
    assert (r.exit_code, r.stderr) == (0, "")
    assert r.stdout.splitlines() == TOY_REPORT


CPU_ENV = {"python": "3.11.7", "platform": "Linux", "torch": "2.13.0+cpu", "cuda": None,
           "cuda_devices": [], "rank": 0, "world_size": 1, "argv": ["train.py", "--lr", "3e-3"],
           "cwd": "/home/u/proj", "git_commit": "0123abcd"}
GPU_ENV = {**CPU_ENV, "torch": "2.13.0+cu128", "cuda": "12.8",
           "cuda_devices": ["NVIDIA H200", "NVIDIA H200"], "rank": 1, "world_size": 2}

INFO_HEAD = [
    "bundle     <BUNDLE> (nanreplay-bundle/1)",
    "event      step 37, phase forward, nan, module norm",
    "detail     nan first in the output of norm (toy_model.UnsafeNorm), call 0",
    "model      toy_model.Classifier (8 modules, 6 parameters), factory toy_model:make_model",
    "training   optimizer torch.optim.adamw.AdamW, loss torch.nn.modules.loss.CrossEntropyLoss, "
    "1 micro-batch(es), 38 steps of history",
]
INFO_HOLDS = [
    "holds",
    "  RNG states             3 tensors       0.02 MB",
    "  batch                  1 tensors       0.00 MB",
    "  gradients              6 tensors       0.03 MB",
    "  loss targets           1 tensors       0.00 MB",
    "  optimizer state       18 tensors       0.05 MB",
    "  output gradients       1 tensors       0.00 MB",
    "  ring buffer           13 tensors       0.02 MB",
    "  weights                6 tensors       0.03 MB",
]


def _with_env(toy: Path, dst: Path, env: dict) -> Path:
    def edit(m):
        m["env"] = env
        return m

    return rewrite(toy, dst, meta=edit)


def _info_lines(path: Path) -> list[str]:
    r = run("--info", path)
    assert (r.exit_code, r.stderr) == (0, ""), r.stderr
    return r.stdout.replace(str(path), "<BUNDLE>").splitlines()


def test_info_golden_cpu(toy, tmp_path):
    b = _with_env(toy, tmp_path / "cpu.nan", CPU_ENV)
    assert _info_lines(b) == INFO_HEAD + [
        "env        python 3.11.7, torch 2.13.0+cpu, cuda None, rank 0/1",
        "run        train.py --lr 3e-3 (commit 0123abcd)",
    ] + INFO_HOLDS


def test_info_golden_gpu(toy, tmp_path):
    b = _with_env(toy, tmp_path / "gpu.nan", GPU_ENV)
    assert _info_lines(b) == INFO_HEAD + [
        "env        python 3.11.7, torch 2.13.0+cu128, cuda 12.8 (NVIDIA H200, NVIDIA H200), "
        "rank 1/2",
        "run        train.py --lr 3e-3 (commit 0123abcd)",
    ] + INFO_HOLDS


def test_info_golden_of_a_stripped_copy(toy, tmp_path):
    b = _with_env(toy, tmp_path / "cpu.nan", CPU_ENV)
    out = tmp_path / "share.nan"
    assert run("--strip", "weights", "--strip", "batch", "-o", out, b).exit_code == 0
    lines = _info_lines(out)
    assert lines[7:] == [
        "stripped   batch, weights",
        "holds",
        "  RNG states             3 tensors       0.02 MB",
        "  ring buffer           13 tensors       0.02 MB",
    ]


# ---------------------------------------------------------------------------------------------
# to_text, one optional line at a time


def _report(**kw) -> dict:
    base = {
        "event": {"step": 12, "phase": "forward", "module": "enc.1", "kind": "nan"},
        "reproduced": True,
        "origin": {"phase": None},
        "cause": None, "hint": None, "precursors": [], "bisection": None, "problems": [],
    }
    base.update(kw)
    return base


def test_minimal_report_is_one_line():
    assert to_text(_report(reproduced=False)).splitlines() == [
        "nanreplay: step 12, forward event — NOT reproduced"]


def test_forward_origin_with_chain_anomaly_samples_and_disagreeing_bisection():
    chain = [{"op": "aten.exp", "made": "+inf", "source": "m.py:3"},
             {"op": "aten.sub", "made": "nan", "intentional": True},
             {"op": "aten.div", "made": "nan", "source": "m.py:4"}]
    text = to_text(_report(
        origin={"phase": "forward", "made": "+inf", "op": "aten.exp", "module": "", "call": 2,
                "micro_batch": 1, "inputs_finite": False, "source": "m.py:3",
                "chain": chain, "samples": list(range(20)), "anomaly_node": "DivBackward0"},
        source_lines={"m.py:3": "        y = x.exp()   "},
        cause="overflow", hint="use float32 for the softmax",
        bisection={"probes": 7, "calls": 30, "limit": 7, "agrees": False},
        problems=["first note", "second note"],
    ))
    assert text.splitlines() == [
        "nanreplay: step 12, forward event — reproduced",
        "  origin     forward: +inf made by aten.exp in <root>, call 2, micro-batch 1",
        "  source     m.py:3    y = x.exp()",
        "  chain      aten.exp made +inf (m.py:3) -> aten.sub made nan [intentional] -> "
        "aten.div made nan (m.py:4)",
        "  anomaly    detect_anomaly names DivBackward0",
        "  samples    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] (+4)",
        "  cause      overflow — use float32 for the softmax",
        "  bisection  7 re-runs over 30 calls (limit 7), DISAGREES with the instrumented pass",
        "  note       first note",
        "  note       second note",
    ]


def test_input_weights_and_optimizer_origins():
    inp = to_text(_report(event={"step": 3, "phase": "input", "module": None},
                          origin={"phase": "input", "made": "nan", "tensor": "batch['x']",
                                  "samples": [2, 7]},
                          cause="input", hint="check the data pipeline"))
    assert inp.splitlines() == [
        "nanreplay: step 3, input event — reproduced",
        "  origin     input: nan made by the input batch['x']",
        "  samples    [2, 7]",
        "  cause      input — check the data pipeline",
    ]
    w = to_text(_report(origin={"phase": "weights", "params": ["a.weight", "b.bias", "c"]},
                        event={"step": 5, "phase": "weights", "kind": "+inf"}, cause="weights"))
    assert w.splitlines()[1] == "  origin     weights: +inf made by parameter a.weight (+2 more)"
    assert w.splitlines()[2] == "  cause      weights"
    o = to_text(_report(origin={"phase": "optimizer", "params": [], "op": "aten.sqrt"},
                        event={"step": 5, "phase": "optimizer", "kind": "nan"}))
    assert o.splitlines()[1] == "  origin     optimizer: nan made by aten.sqrt in the parameters"


def test_precursors_are_listed_ten_at_most():
    pre = [{"step": s, "kind": "grad_norm_jump", "detail": f"gradient norm jump {s}"}
           for s in range(100, 113)]
    lines = to_text(_report(precursors=pre)).splitlines()
    assert lines[1:] == ["  precursors"] + [
        f"    step {s:>6}  grad_norm_jump  gradient norm jump {s}" for s in range(100, 110)
    ] + ["    ... 3 more"]


def _ddp_set(toy: Path, where: Path, ranks: tuple[int, ...]) -> dict[int, Path]:
    """The toy bundle as the bundles of ranks ``ranks`` of a two-rank DDP event that rank 1
    saw first (rank 0's own event is the toy's too: only the rank fields differ)."""
    out = {}
    for rank in ranks:
        def edit(m, rank=rank):
            m["event"]["ranks"] = {"run_id": "0123456789abcdef", "rank": rank, "world_size": 2,
                                   "first": [1], "seen_by": [0, 1]}
            m["env"].update(rank=rank, world_size=2)
            return m

        out[rank] = rewrite(toy, where / f"step00000037-rank{rank}.nan", meta=edit)
    return out


def test_report_says_which_ranks_bundle_it_replayed(toy, tmp_path, monkeypatch):
    """Rank 0's bundle of an event rank 1 saw first replays rank 1's bundle beside it: its
    samples are rows of rank 1's batch. The text report did not say so (only --json's bundle
    rank did), so a user looked up sample 5 in rank 0's batch."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(EXAMPLES)
    rank0 = _ddp_set(toy, tmp_path / "set", (0, 1))[0]
    r = run(rank0)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == (
        f"  rank       replayed rank 1's bundle {tmp_path / 'set' / 'step00000037-rank1.nan'}, "
        "the first rank to see the event (the samples are rows of its batch); the bundle given "
        "is rank 0's")
    assert lines[2:] == TOY_REPORT[1:]
    rep = json.loads(run(rank0, "--json").stdout)["bundle"]
    assert (rep["rank"], rep["given"], rep["given_rank"], rep["first_ranks"]) == \
        (1, str(rank0), 0, [1])
    # rank 1's own bundle: nothing to say
    assert run(tmp_path / "set" / "step00000037-rank1.nan").stdout.splitlines() == TOY_REPORT
    # rank 0's bundle alone (its own event, replayed as it is): it is rank 0's view
    alone = _ddp_set(toy, tmp_path / "alone", (0,))[0]
    lines = run(alone).stdout.splitlines()
    assert lines[1] == ("  rank       rank 0 of 2: rank(s) [1] saw the event first; this is "
                        "rank 0's own view: replay rank 1's bundle to see where it began")
