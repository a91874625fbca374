"""Bundle writes that never finished, in an out_dir a scheduler's restarted job reuses: a writer
killed mid-write (SIGKILL) leaves its full-size temporary file, which the next recorder on that
out_dir removes with one warning; a live writer's (another rank still writing) and another
host's (a shared file system) are never touched; nanreplay says what such a file is; a disk
full for the temporary directory too is not written twice."""

from __future__ import annotations

import errno
import logging
import signal
import subprocess
import sys
from pathlib import Path

from bundles import invoke_cli, one_error_line
from test_bundle_writes import BAD_STEP, HERE, event_of, make_model

import recorder.bundle as bundle_mod
from recorder import FlightRecorder

# the run as a user starts it, paused mid-write of its bundle (after it said so on stdout)
# until the test lets go or kills it with SIGKILL
_PAUSED = """
import os, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
import recorder.bundle as b
real = b._host_bytes
def host_bytes(t):
    if t.numel() == 16:   # proj.bias, well into the bundle's tensors
        print("writing", flush=True)
        sys.stdin.readline()
    return real(t)
b._host_bytes = host_bytes
import test_bundle_writes
test_bundle_writes.train(__import__("pathlib").Path({out!r}))
"""


def _attach(out_dir: Path, model) -> None:
    FlightRecorder(model, out_dir=out_dir)


def _while_writing(child, out_dir: Path, caplog) -> None:
    """The paused writer's file, seen while it lives: nanreplay says to wait for it, and a
    recorder starting on the same out_dir (another rank) leaves it alone, silently."""
    assert child.stdout.readline() == b"writing\n"
    (tmp,) = out_dir.iterdir()
    assert tmp.name.startswith(f".step{BAD_STEP:08d}-rank0.@") and tmp.suffix == ".tmp"
    line = one_error_line(invoke_cli(tmp))
    assert line == (f"nanreplay: {tmp}: an unfinished write of bundle step{BAD_STEP:08d}"
                    f"-rank0.nan by process {child.pid} on this host, which is still "
                    "running; it holds no complete step and cannot be replayed: wait for "
                    f"it to write step{BAD_STEP:08d}-rank0.nan"), line
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        _attach(out_dir, make_model())
    assert tmp.exists() and not caplog.records


def test_a_killed_writers_file_is_removed_by_the_next_run_and_a_live_ones_kept(
        tmp_path, caplog, monkeypatch):
    out_dir = tmp_path / "nan-bundles"
    code = _PAUSED.format(tests=str(HERE), root=str(HERE.parent), out=str(out_dir))
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as child:
        try:
            _while_writing(child, out_dir, caplog)
        finally:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    (tmp,) = out_dir.iterdir()  # (the live writer's, kept)
    size = tmp.stat().st_size
    line = one_error_line(invoke_cli(out_dir))
    assert f"only 1 unfinished one(s) ({tmp.name}: an unfinished write" in line, line
    assert "which is gone: its writer was killed before it finished; it holds no complete " \
           "step and cannot be replayed: delete it" in line, line
    # the scheduler's restart of the job: its recorder frees the space, said in one line
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        err = event_of(out_dir)
    said = [r.getMessage() for r in caplog.records if "unfinished" in r.getMessage()]
    assert said == [f"nanreplay: removed 1 unfinished bundle file(s) ({size} bytes) from "
                    f"out_dir '{out_dir}', left by writers killed mid-write"], said
    assert sorted(p.name for p in out_dir.iterdir()) == [Path(err.bundle_path).name]


def test_other_hosts_and_old_names_are_left_alone_and_said_once(tmp_path, caplog):
    out_dir = tmp_path / "nan-bundles"
    out_dir.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    other = out_dir / f".step00000003-rank1.@node17-4026531836.{gone}.123.456.tmp"
    old = out_dir / f".step00000003-rank2.{gone}.456.tmp"
    for f in (other, old):
        f.write_bytes(b"\0" * 100)
    import torch
    with caplog.at_level(logging.WARNING, logger="nanreplay"):
        _attach(out_dir, torch.nn.Linear(2, 2))
        _attach(out_dir, torch.nn.Linear(2, 2))
    assert other.exists() and old.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"nanreplay: out_dir '{out_dir}' holds unfinished bundle file(s); 2 of another host or "
        "an older version left alone (delete them once no run writes there)"]
    line = one_error_line(invoke_cli("--info", other))
    assert line == (f"nanreplay: {other}: an unfinished write of bundle step00000003-rank1.nan "
                    f"by process {gone} on host node17-4026531836, still being written there or "
                    "its writer was killed before it finished; it holds no complete step and "
                    "cannot be replayed: delete it once no run writes to this directory"), line


def test_a_disk_full_for_the_temporary_directory_too_is_not_written_twice(
        tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the same file system as out_dir
    calls = []

    def write(out_dir, *args, **kwargs):
        calls.append(Path(out_dir))
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(bundle_mod, "write_bundle", write)
    out_dir = tmp_path / "nan-bundles"
    err = event_of(out_dir)
    assert calls == [out_dir] and err.bundle_path is None
    assert (f"Writing the bundle failed: No space left on device (in out_dir '{out_dir}'; not "
            "written again in the temporary directory: it is on the same file system); free "
            "space (or raise the quota), or give the recorder an out_dir with room." in str(err))
    assert [p.name for p in tmp_path.iterdir()] == ["nan-bundles"]
