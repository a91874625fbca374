"""DDP ranks started by ``torch.multiprocessing.spawn`` (PyTorch's DDP tutorial), not torchrun:
no RANK/WORLD_SIZE variables, the script re-run in each child as ``__mp_main__``."""

import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from bundles import nanreplay_json
from torch.utils.data.distributed import DistributedSampler

from recorder.bundle import read_bundle

HERE = Path(__file__).parent / "dist"
sys.path.insert(0, str(HERE))
import spawn_train  # noqa: E402

BAD_ROW = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _where(row: int) -> tuple[int, int, int]:
    """(rank, step, sample) of dataset row ``row``, as the script's samplers hand it out."""
    n = len(spawn_train.make_data())
    for epoch in range(spawn_train.EPOCHS):
        for rank in (0, 1):
            s = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)
            s.set_epoch(epoch)
            order = list(s)
            if row in order:
                at = order.index(row)
                steps = len(order) // spawn_train.BATCH
                return rank, epoch * steps + at // spawn_train.BATCH, at % spawn_train.BATCH
    raise AssertionError(row)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("spawn")
    path = os.pathsep.join([str(HERE), str(HERE.parent.parent)])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
    # a hang (a rank waiting for another, or at the process group's teardown) fails here
    proc = subprocess.run([sys.executable, str(HERE / "spawn_train.py"), str(out),
                           str(_free_port()), str(BAD_ROW)],
                          capture_output=True, text=True, env=env, timeout=240)
    return out, proc


def test_spawned_healthy_ranks_train_as_without_the_recorder(spawned):
    out, proc = spawned
    for rank in (0, 1):
        plain, recorded = map(ast.literal_eval,
                              (out / f"losses-rank{rank}.txt").read_text().splitlines())
        steps = len(spawn_train.make_data()) // 2 // spawn_train.BATCH * spawn_train.EPOCHS
        assert len(plain) == steps and plain == recorded  # bit-identical, every step
    healthy = proc.stderr.split("Traceback")[0]  # (before the planted run's error)
    assert "Warning" not in healthy and "nanreplay" not in healthy, healthy


def test_spawned_rank_nan_names_rank_step_samples_and_replays(spawned, monkeypatch):
    out, proc = spawned
    rank, step, sample = _where(BAD_ROW)
    bundle = out / "bad" / f"step{step:08d}-rank{rank}.nan"
    # mp.spawn re-raises the error of whichever rank failed first: either names the step, the
    # rank that saw it first and a bundle nanreplay replays that rank from
    assert proc.returncode != 0
    said = proc.stderr.split("ProcessRaisedException")[-1]
    assert f"non-finite value (NaN) at step {step}" in said, proc.stderr
    assert f"first seen on rank(s) {rank} " in said
    assert f"`nanreplay {out / 'bad'}{os.sep}step{step:08d}-rank" in said
    assert sorted(p.name for p in (out / "bad").iterdir()) == sorted(
        f"step{step:08d}-rank{r}.nan" for r in (0, 1))
    meta, _ = read_bundle(bundle)
    assert meta["env"]["rank"] == rank and meta["env"]["world_size"] == 2
    # the script ran as __mp_main__ in the child: the replay imports it by its own name
    assert meta["model"]["default_factory"] == "spawn_train:ToyModel"
    monkeypatch.chdir(HERE)
    for given in (0, 1):  # either rank's bundle replays the rank that saw it
        rep = nanreplay_json(out / "bad" / f"step{step:08d}-rank{given}.nan")
        assert rep["event"]["step"] == step and rep["cause"] == "input"
        assert rep["origin"]["tensor"] == "batch" and rep["origin"]["samples"] == [sample]
        assert "__mp_main__" not in str(rep)
