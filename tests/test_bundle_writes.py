"""Bundles where real runs write them: a write killed midway (SIGKILL while the bundle streams
out), a run again in the out_dir of an earlier one, a copy cut short, a file size limit at the
event. No partial file is ever taken for a bundle, nothing earlier is overwritten, each bad file
or failed write is said in one line, and the training failure is never masked."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bundles import invoke_cli, one_error_line
from torch import nn

import recorder.bundle as bundle_mod
from recorder import FlightRecorder, NonFiniteError
from replay import replay

HERE = Path(__file__).parent
BAD_STEP, BAD_ROW = 3, 5


class MaskedMean(nn.Module):
    """Mean of a projection over the present (non-zero) frames: 0/0 for a blank recording."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        present = (x.abs().sum(-1, keepdim=True) > 0).float()
        h = (self.proj(x) * present).sum(1) / present.sum(1)  # BUG: no guard for no frames
        return self.head(h)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return MaskedMean()


def train(out_dir: Path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with FlightRecorder(model, opt, loss_fn=crit, out_dir=out_dir,
                        factory="test_bundle_writes:make_model"):
        for step in range(6):
            x, y = torch.randn(8, 5, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if step == BAD_STEP:
                x[BAD_ROW] = 0.0  # a blank recording
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()


def event_of(out_dir: Path) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        train(out_dir)
    return info.value


def check_replays_to_the_bug(path: Path, monkeypatch) -> None:
    monkeypatch.chdir(HERE)
    report = replay(path)
    assert report["reproduced"] is True and report["event"]["step"] == BAD_STEP
    origin = report["origin"]
    assert (origin["phase"], origin["module"], origin["op"]) == ("forward", "", "aten.div")
    assert origin["samples"] == [BAD_ROW] and report["cause"] == "invalid"


# the run as a user starts it, killed (SIGKILL: no handler, no finally) while its bundle streams
_KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
import recorder.bundle as b
real = b._host_bytes
def host_bytes(t):
    if t.numel() == 16:   # proj.bias, well into the bundle's tensors
        os.kill(os.getpid(), signal.SIGKILL)
    return real(t)
b._host_bytes = host_bytes
import test_bundle_writes
test_bundle_writes.train(__import__("pathlib").Path({out!r}))
"""


def test_a_write_killed_midway_leaves_no_bundle_and_the_next_run_writes_its_own(
        tmp_path, monkeypatch):
    out_dir = tmp_path / "nan-bundles"
    code = _KILLED.format(tests=str(HERE), root=str(HERE.parent), out=str(out_dir))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    left = list(out_dir.iterdir())
    assert [f.suffix for f in left] == [".tmp"] and left[0].name.startswith(".")
    # the out_dir holds no bundle: said in one line, naming the unfinished file
    line = one_error_line(invoke_cli(out_dir))
    assert "with no *.nan bundle in it, only 1 unfinished one(s)" in line, line
    assert left[0].name in line and "its writer was killed" in line, line
    line = one_error_line(invoke_cli("--info", left[0]))
    assert line.startswith(f"nanreplay: {left[0]}: "), line
    # the next run in the same out_dir writes the step's name, which the killed one never took
    err = event_of(out_dir)
    assert Path(err.bundle_path) == out_dir / f"step{BAD_STEP:08d}-rank0.nan"
    check_replays_to_the_bug(Path(err.bundle_path), monkeypatch)


def test_a_run_again_in_the_same_out_dir_keeps_the_earlier_bundle(tmp_path, monkeypatch):
    out_dir = tmp_path / "nan-bundles"
    first = Path(event_of(out_dir).bundle_path)
    before = first.read_bytes()
    second = Path(event_of(out_dir).bundle_path)
    assert first.name == f"step{BAD_STEP:08d}-rank0.nan"
    assert second.name == f"step{BAD_STEP:08d}-rank0-1.nan"
    assert first.read_bytes() == before  # never overwritten
    line = one_error_line(invoke_cli(out_dir))  # two events: name one, the first written first
    assert line.endswith(f"holds the bundles of 2 events ({first.name}, {second.name}); name "
                         f"one: the earliest step's is {first} (nanreplay --help lists the "
                         "options)"), line
    check_replays_to_the_bug(second, monkeypatch)


@pytest.mark.parametrize("keep", [0, 40, 0.5, -30])
def test_a_copy_cut_short_is_refused_in_one_line_even_by_info(tmp_path, keep):
    path = Path(event_of(tmp_path / "run").bundle_path)
    data = path.read_bytes()
    cut = tmp_path / "copy.nan"
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    cut.write_bytes(data[:n])
    for args in (("--info", cut), (cut,)):
        line = one_error_line(invoke_cli(*args))
        what = "empty (0 bytes)" if n == 0 else f"truncated: it ends at byte {n}, "
        assert line.startswith(f"nanreplay: {cut}: {what}"), line
        assert line.endswith("copy it again from where the recorder wrote it, or re-run the "
                             "training to record a new bundle"), line


@pytest.mark.parametrize("error, says", [
    (OSError(errno.EFBIG, "File too large"),
     "File too large (in out_dir '{out}' and in a new temporary directory); raise the file size "
     "limit (ulimit -f, or the job scheduler's)"),
    (RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors "
                  "might be asynchronously reported"),
     "RuntimeError: CUDA error: an illegal memory access was encountered"),
])
def test_a_failed_write_still_raises_the_event_in_one_line(tmp_path, monkeypatch, error, says):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def write(*args, **kwargs):
        raise error
    monkeypatch.setattr(bundle_mod, "write_bundle", write)
    out_dir = tmp_path / "nan-bundles"
    err = event_of(out_dir)
    msg = str(err)
    assert "\n" not in msg and err.bundle_path is None and err.write_error is error
    assert msg.startswith(f"nanreplay: non-finite value (NaN) at step {BAD_STEP}, phase forward"
                          ), msg
    assert f"Writing the bundle failed: {says.format(out=out_dir)}" in msg, msg
    assert [p.name for p in tmp_path.iterdir()] == ["nan-bundles"]  # no spare left behind
    assert os.listdir(out_dir) == []
