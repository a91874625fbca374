"""DDP training as users write it, under real torchrun (2 ranks, gloo, CPU): DistributedSampler
with set_epoch, a DataLoader of dict batches, gradient accumulation with ``no_sync()``, a batch
norm whose statistics are all-reduced (SyncBatchNorm's job; torch's refuses CPU tensors),
``find_unused_parameters=True`` with a pair branch used every other step, a contrastive loss
that all-gathers every rank's embeddings, clipping, an all-reduce of the logged loss, a
checkpoint on rank 0, and uneven inputs under ``Join``. One torchrun launch runs every mode
(see ``ddp_stack_models.main``), each with a fresh model and recorder."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import ddp_stack_models as M
import pytest
from bundles import nanreplay_json, source_line

pytestmark = pytest.mark.usefixtures("in_tests_dir")

HERE = Path(__file__).parent
MODELS = "ddp_stack_models.py"
MODES = ("healthy", "healthy-bare", "static", "static-bare", "shard", "cancel", "pair", "adam", "temperature",
         "join-bare", "join", "joinbad", "joinwarn", "joinguard", "joininnerguard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Every mode's per-rank line (``{(rank, mode): text}``) and the bundles' directory."""
    out = tmp_path_factory.mktemp("ddp-stack")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    for _ in range(2):  # (once more when the free port was taken before the rendezvous)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(HERE / MODELS), str(out), *MODES]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE,
                              timeout=240)
        if "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    said = "".join((out / f"rank{r}.txt").read_text() for r in (0, 1))
    lines = {(int(r), m): t for r, m, t in re.findall(r"rank (\d) (\S+) ([^\n]*)", said)}
    assert len(lines) == 2 * len(MODES), proc.stdout
    return lines, out


def _both(lines, mode):
    return lines[(0, mode)], lines[(1, mode)]


def test_healthy_run_raises_nothing_and_trains_bit_identically(run):
    lines, _ = run
    for mode in ("healthy", "static", "join"):  # (join: uneven inputs, the recorder in Join)
        recorded, bare = _both(lines, mode), _both(lines, mode + "-bare")
        assert recorded == bare, (recorded, bare)
        assert recorded[0].startswith("done steps=") and recorded[0].split()[2] == \
            recorded[1].split()[2]  # (every rank holds the same weights)
    assert _both(lines, "healthy")[0].startswith("done steps=8 ")
    assert _both(lines, "static")[0].startswith("done steps=8 ")
    assert [lines[(r, "join")].split()[1] for r in (0, 1)] == ["steps=10", "steps=6"]


def test_a_corrupt_shard_on_rank_1_inside_no_sync(run):
    """Rank 1's copy of the data holds a NaN feature in the second row of step 2's first
    micro-batch (under ``no_sync()``). Rank 0's forward sees the NaN too, through the batch
    norm's all-reduced statistics: both stop at step 2, rank 1 first, and either bundle
    replays rank 1's micro-batch 0, sample 1."""
    lines, out = run
    assert _both(lines, "shard") == (
        "event step=2 phase=forward first=[1] bundle=step00000002-rank0.nan",
        "event step=2 phase=input first=[1] bundle=step00000002-rank1.nan")
    rep = nanreplay_json(out / "shard" / "step00000002-rank0.nan")
    assert rep["bundle"]["rank"] == 1 and rep["event"]["step"] == 2
    o = rep["origin"]
    assert (rep["cause"], o["phase"], o["samples"], o["micro_batch"]) == ("input", "input",
                                                                          [1], 0)
    assert "sample 1 at feature(s) 3" in rep["hint"]


def test_one_pass_variance_of_the_synchronised_batch_norm(run):
    """A raw reading around 3000 with a spread of 0.01: the all-reduced E[x²] - E[x]² is
    negative in float32 at step 0 on every rank: rsqrt in norm, precision."""
    lines, out = run
    assert _both(lines, "cancel")[0].startswith("event step=0 phase=forward first=[0, 1]")
    rep = nanreplay_json(out / "cancel" / "step00000000-rank0.nan")
    o = rep["origin"]
    assert (rep["cause"], o["op"], o["module"], rep["event"]["step"]) == \
        ("precision", "aten.rsqrt", "norm", 0)
    assert o["source"] == source_line(MODELS, "# LINE bn")
    assert o["samples"] == [0, 1, 2, 3]  # (a statistic of the whole batch)


def test_adamw_eps_0_on_domain_rows_no_rank_ever_sees(run):
    lines, out = run
    assert _both(lines, "adam") == (
        "event step=0 phase=optimizer first=[0, 1] bundle=step00000000-rank0.nan",
        "event step=0 phase=optimizer first=[0, 1] bundle=step00000000-rank1.nan")
    rep = nanreplay_json(out / "adam" / "step00000000-rank1.nan", code=1)
    assert (rep["cause"], rep["event"]["step"]) == ("optimizer", 0)
    assert "row(s) 4, 5 of 6 of domain.weight" in rep["hint"] and "eps=0" in rep["hint"]


@pytest.mark.parametrize("mode,step,phase", [("pair", 3, "backward"),
                                             ("temperature", 2, "loss")])
def test_a_forward_over_every_ranks_statistics_is_named_not_a_different_factory(
        run, mode, step, phase):
    """A self-paired row's sqrt at 0 in the unused-parameter branch (backward) and an annealed
    InfoNCE temperature whose probabilities underflow to 0 under log (loss): in the single-process
    re-run the batch norm's statistics are rank 0's batch alone, not both ranks', so nothing
    after it re-runs as trained. The fidelity line said "the factory builds a different model"
    (advising factory_kwargs, which cannot help); it now names the module whose forward reads
    the process group, its line, and why the step cannot be re-run as it ran."""
    lines, out = run
    assert _both(lines, mode)[0].startswith(f"event step={step} phase={phase} first=[0, 1]")
    rep = nanreplay_json(out / mode / f"step{step:08d}-rank0.nan", code=1)
    assert rep["event"]["step"] == step and rep["cause"] is None
    fid = rep["fidelity"]
    assert (fid["module"], fid["world"]["class"]) == ("norm", "AllReduceBatchNorm")
    assert fid["world"]["source"] == \
        f"{MODELS}:{M.AllReduceBatchNorm.forward.__code__.co_firstlineno}"
    assert "every rank's values in training" in rep["hint"]
    assert "factory builds a different model" not in rep["hint"]


def test_a_nan_after_the_other_rank_joined_stops_both(run):
    """Uneven inputs under the user's own ``Join([ddp])``: rank 1 runs out after 6 steps; at
    step 8 rank 0's batch holds an Inf. Rank 0's per-step agreement used to wait for rank 1
    (which only shadowed DDP's all-reduce): training hung. The recorder's hook behind DDP's
    join hook makes rank 1 match it and raise at the same step, naming rank 0, whose bundle
    replays to the sample."""
    lines, out = run
    assert _both(lines, "joinbad") == ("event step=8 phase=input",
                                       "event step=8 phase=peer")
    assert sorted(p.name for p in (out / "joinbad").iterdir()) == ["step00000008-rank0.nan"]
    rep = nanreplay_json(out / "joinbad" / "step00000008-rank0.nan")
    assert (rep["cause"], rep["origin"]["samples"], rep["event"]["step"]) == ("input", [3], 8)
    # on_event="warn": rank 0 writes its bundle at step 8 and both ranks train to the end
    assert [lines[(r, "joinwarn")].split()[:2] for r in (0, 1)] == [["done", "steps=10"],
                                                                     ["done", "steps=6"]]
    assert sorted(p.name for p in (out / "joinwarn").iterdir()) == ["step00000008-rank0.nan"]


def test_join_with_guard_optimizer_is_refused_in_one_line(run):
    """guard_optimizer=True reads a second time per step, which a joined rank cannot tell from
    the next step's: the user's ``Join([ddp])`` is refused on every rank as it is built, in
    one line, rather than hang at the first step after a rank ran out."""
    lines, _ = run
    for said in _both(lines, "joinguard") + _both(lines, "joininnerguard"):
        assert said.startswith("refused nanreplay: Join cannot shadow guard_optimizer=True"), said
        assert "\n" not in said


def test_syncbatchnorm_is_found_below_the_diverging_module():
    """torch's SyncBatchNorm refuses CPU tensors, so no CPU run records one; the fidelity
    check finds it all the same, at or below the first module whose values differ, in a bundle
    of several ranks only."""
    from types import SimpleNamespace

    from torch import nn

    from replay.world_forward import world_forward

    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4))
    step = SimpleNamespace(meta={"env": {"world_size": 4}}, model=model)
    assert world_forward(step, "") == {"class": "SyncBatchNorm", "world_size": 4,
                                       "source": "torch.nn.SyncBatchNorm.forward"}
    assert world_forward(step, "0") is None  # (the Linear before it)
    assert world_forward(SimpleNamespace(meta={"env": {"world_size": 1}}, model=model),
                         "") is None
    plain = SimpleNamespace(meta={"env": {"world_size": 4}},
                            model=nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    assert world_forward(plain, "") is None
