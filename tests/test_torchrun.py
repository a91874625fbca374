"""Real torchrun: two DDP ranks on CPU, a NaN sample on rank 1 only."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recorder.bundle import read_bundle

HERE = Path(__file__).parent / "dist"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, out: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    """Two ranks of ``script OUT`` under torchrun; once more on a new port if the free one
    was taken before the rendezvous bound it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pythonpath)}
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(HERE / script), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                              cwd=HERE)
        if "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc


def test_two_ranks_each_write_their_bundle_and_stop(tmp_path):
    out = tmp_path / "bundles"
    proc = _torchrun("ddp_train.py", out, HERE)
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
    assert report["bundle"]["rank"] == 1 and report["event"]["step"] == 3
    assert report["reproduced"] is True


def test_trainer_callback_on_two_ranks_in_warn_mode(tmp_path):
    """transformers.Trainer under torchrun (DDP, gloo): rank 1's all-padding batch at step 3 is
    written to its bundle, in warn mode both ranks train to the end, and the bundle replays to
    the op in transformers' loss code."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "bundles"
    proc = _torchrun("hf_ddp_train.py", out, HERE.parent)
    # the two ranks print concurrently: their lines may run into each other
    lines = dict(re.findall(r"rank (\d) (steps=\d+ event=\S+ bundle=(?:None|\S+?\.nan))",
                            proc.stdout))
    assert lines == {"0": "steps=6 event=None/None bundle=None",
                     "1": f"steps=6 event=3/forward bundle={out / 'step00000003-rank1.nan'}"}, \
        proc.stdout
    meta, _ = read_bundle(out / "step00000003-rank1.nan")
    assert meta["env"]["rank"] == 1 and meta["env"]["world_size"] == 2
    assert meta["factory"] == "hf_models:make_tiny_gpt2"
    rep = subprocess.run([sys.executable, "-m", "replay", "--json",
                          str(out / "step00000003-rank1.nan")],
                         capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    report = json.loads(rep.stdout)
    assert report["reproduced"] is True and report["cause"] == "invalid"
    assert report["origin"]["op"] == "aten.div" and report["bundle"]["rank"] == 1
    assert report["event"]["step"] == 3
