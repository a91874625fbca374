"""Real torchrun: two DDP ranks on CPU, a NaN sample on rank 1 only."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from recorder.bundle import read_bundle

HERE = Path(__file__).parent / "dist"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_each_write_their_bundle_and_stop(tmp_path):
    out = tmp_path / "bundles"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", str(HERE / "ddp_train.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # the two ranks print concurrently: their lines may interleave
    events = dict(re.findall(r"rank (\d) event (step=\d+ phase=\w+ tensor=\S+ samples=\[[^\]]*\])",
                             proc.stdout))
    assert set(events) == {"0", "1"}, proc.stdout
    # rank 1 saw its own bad sample; rank 0 saw the averaged gradient it produced
    assert "step=3 phase=input" in events["1"] and "samples=[2]" in events["1"]
    assert "step=3 phase=backward" in events["0"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step00000003-rank0.nan", "step00000003-rank1.nan"]
    meta, tensors = read_bundle(out / "step00000003-rank1.nan")
    assert meta["env"]["rank"] == 1 and meta["env"]["world_size"] == 2
    assert meta["event"]["tensor"] == "batch" and meta["event"]["samples"] == [2]
    # the wrapper is unwrapped: names are the inner model's, so its factory rebuilds it
    assert meta["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not bool(tensors["batch/0/0"][2].isfinite().all())
    # and the bundle replays from the directory where its factory lives
    rep = subprocess.run([sys.executable, "-m", "replay", "--json",
                          str(out / "step00000003-rank1.nan")],
                         capture_output=True, text=True, timeout=120, cwd=HERE)
    report = json.loads(rep.stdout)
    assert report["cause"] == "input" and report["origin"]["samples"] == [2]
    assert report["bundle"]["rank"] == 1
