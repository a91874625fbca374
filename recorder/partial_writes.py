"""Temporary files of bundle writes, and the ones whose write never finished.

:func:`recorder.bundle.write_bundle` streams into ``out_dir/.{stem}.@{host}.{pid}.{start}.{tid}
.tmp`` and links it to its name once complete. A writer killed mid-way (SIGKILL, the OOM killer,
a scheduler's time limit) leaves that file at its full size; a job restarted into the same
out_dir that dies again leaves another. Their names say who wrote them, so that a recorder
starting on an out_dir removes those whose writer is provably gone (:func:`sweep`) and never a
live one's: other ranks write into the same out_dir at the same moment, possibly from other
hosts on a shared file system. ``start`` is the writer's start time (Linux's
``/proc/<pid>/stat``, 0 where unknown): a pid reused by another process is not the writer.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import tempfile
import threading
from functools import cache
from pathlib import Path

try:
    import resource
except ImportError:  # (Windows: no file size limit to read)
    resource = None

log = logging.getLogger("nanreplay")

_NAMED = re.compile(r"\.(?P<stem>.+)\.@(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?P<start>\d+)"
                    r"\.(?P<tid>\d+)\.tmp")
# the names written before the host was part of them: whose they are cannot be told
_OLD = re.compile(r"\.(?P<stem>.+)\.(?P<pid>\d+)\.(?P<tid>\d+)\.tmp")
_reported: set[str] = set()  # the other hosts' files already said


@cache
def host_tag() -> str:
    """This host as a name part: its hostname, and its pid namespace where it has one (two
    containers may share a hostname, never a pid namespace's pids)."""
    tag = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"
    try:
        ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return tag
    return f"{tag}-{''.join(c for c in ns if c.isdigit())}"


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); 0 where this system does not
    say; None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        return None if not _exists(pid) else 0
    except (OSError, ValueError, IndexError):
        return 0 if _exists(pid) else None


def _exists(pid: int) -> bool:
    if os.name == "nt":  # (os.kill there terminates the process: never asked, never gone)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: it exists)
        return True
    return True


def temp_name(stem: str) -> str:
    """The temporary file name of this process's and thread's write of bundle ``stem``."""
    pid = os.getpid()
    return (f".{stem}.@{host_tag()}.{pid}.{start_time(pid) or 0}.{threading.get_ident()}"
            ".tmp")


def writer_of(name: str) -> dict | None:
    """Who wrote the temporary file ``name``: ``{"stem", "pid", "host", "gone"}`` (``host`` None
    and ``gone`` None for a name without its host; ``gone`` None for another host's), None for a
    name that is no bundle's temporary file."""
    if (m := _NAMED.fullmatch(name)) is not None:
        pid, start = int(m["pid"]), int(m["start"])
        gone = None
        if m["host"] == host_tag():
            now = start_time(pid)
            gone = now is None or bool(start and now and now != start)
        return {"stem": m["stem"], "pid": pid, "host": m["host"], "gone": gone}
    if (m := _OLD.fullmatch(name)) is not None:
        return {"stem": m["stem"], "pid": int(m["pid"]), "host": None, "gone": None}
    return None


def sweep(out_dir: Path) -> None:
    """Remove the temporary bundle files in ``out_dir`` whose writer is gone, with one warning
    saying how many and how many bytes; those of other hosts (or without a host in their name)
    are left alone and counted. Never raises: a recorder starts whatever this finds."""
    removed, freed, kept = 0, 0, 0
    try:
        entries = [e for e in os.scandir(out_dir) if e.name.endswith(".tmp")]
    except OSError:
        return
    for e in entries:
        if (who := writer_of(e.name)) is None:
            continue
        if not who["gone"]:
            if who["gone"] is None and e.path not in _reported:  # (once: a Trainer callback's
                _reported.add(e.path)                             # options are checked twice)
                kept += 1
            continue
        try:
            size = e.stat().st_size
            os.unlink(e.path)
        except OSError:
            continue
        removed, freed = removed + 1, freed + size
    if removed or kept:
        did = (f"removed {removed} unfinished bundle file(s) ({freed} bytes) from out_dir "
               f"'{out_dir}', left by writers killed mid-write" if removed else
               f"out_dir '{out_dir}' holds unfinished bundle file(s)")
        rest = (f"; {kept} of another host or an older version left alone (delete them once "
                "no run writes there)" if kept else "")
        log.warning("nanreplay: %s%s", did, rest)


def spare_futile(out_dir: Path, e: OSError) -> str | None:
    """Why writing the bundle again into the temporary directory after ``out_dir`` refused it
    with ``e`` cannot succeed (and would only cost a second full write), or None: the process's
    own file size limit holds everywhere, and a full disk or quota is as full for a temporary
    directory on the same file system."""
    if e.errno == errno.EFBIG:
        if resource is not None and resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            return "this process's file size limit applies there too"
        return None
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    if same_file_system(out_dir, Path(tempfile.gettempdir())):
        return "it is on the same file system"
    return None


def same_file_system(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are on one file system (False when either cannot be read)."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def describe(name: str) -> str | None:
    """What the temporary file ``name`` is and what to do with it, in words (for nanreplay
    given it, or an out_dir holding only such files); None for a name that is none."""
    if (who := writer_of(name)) is None:
        return None
    what = f"an unfinished write of bundle {who['stem']}.nan by process {who['pid']}"
    later = "delete it once no run writes to this directory"
    if who["host"] is None:
        where, todo = ("(a name without its host: an older version's), still being written "
                       "or its writer was killed before it finished"), later
    elif who["gone"] is None:
        where, todo = (f"on host {who['host']}, still being written there or its writer was "
                       "killed before it finished"), later
    elif who["gone"]:
        where, todo = ("on this host, which is gone: its writer was killed before it "
                       "finished"), "delete it (a recorder started on this out_dir removes it)"
    else:
        where, todo = ("on this host, which is still running",
                       f"wait for it to write {who['stem']}.nan")
    return f"{what} {where}; it holds no complete step and cannot be replayed: {todo}"
