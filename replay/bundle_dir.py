"""A run's ``out_dir`` given where a bundle is expected (``nanreplay nan-bundles``,
``replay.replay("nan-bundles")``, as a user types it after the crash): the one event's bundle
there, for the command line and the Python API alike."""

from __future__ import annotations

import re
from pathlib import Path

from recorder.partial_writes import describe

from .errors import ReplayError


def bundle_path(path) -> Path:
    """``path`` as the bundle to read: itself, or the one event's bundle of a directory."""
    path = Path(path)
    if path.is_dir():
        return bundle_in(path)
    check_finished(path)
    return path


def bundle_in(directory: Path) -> Path:
    """The bundle of the one event in ``directory`` (a run's ``out_dir``: one file per rank
    that saw it, ``stepNNNNNNNN-rankR.nan``), its lowest rank's; a ReplayError naming them when
    it holds none or several events' (the earliest step's first: the run's first event)."""
    files = sorted(directory.glob("*.nan"), key=_written_order)
    events: dict[str, list[Path]] = {}
    for f in files:
        events.setdefault(re.sub(r"-rank\d+", "", f.name), []).append(f)
    if len(events) == 1:
        return min(files, key=lambda f: int(m.group(1)) if (
            m := re.search(r"-rank(\d+)", f.name)) else 0)
    if not events:
        raise ReplayError(f"{directory} is a directory with no *.nan bundle in it"
                          f"{_unfinished(directory)}; pass the bundle file the recorder "
                          "wrote (its out_dir holds them)")
    names = [group[0] for group in events.values()]
    listed = ", ".join(f.name for f in names[:4]) + (f" (+{len(names) - 4} more)"
                                                     if len(names) > 4 else "")
    raise ReplayError(f"{directory} holds the bundles of {len(names)} events ({listed}); "
                      f"name one: the earliest step's is {names[0]}")


def _written_order(f: Path) -> tuple[int, int, int, str]:
    """``stepNNNNNNNN-rankR[-K].nan`` by step, then by K (the writer's ``-1``, ``-2``... for a
    name an earlier run's bundle had: written after it), then rank; others by name last."""
    m = re.fullmatch(r"step(\d+)-rank(\d+)(?:-(\d+))?\.nan", f.name)
    if m is None:
        return (1 << 62, 0, 0, f.name)
    return (int(m.group(1)), int(m.group(3) or 0), int(m.group(2)), f.name)


def _unfinished(directory: Path) -> str:
    """The temporary files of bundles whose write has not finished (a write in progress, or
    one whose process was killed: see ``recorder.partial_writes``)."""
    left = sorted(f.name for f in directory.glob(".*.tmp") if describe(f.name) is not None)
    if not left:
        return ""
    return (f", only {len(left)} unfinished one(s) ({left[0]}{', ...' if len(left) > 1 else ''}"
            f": {describe(left[0])})")


def check_finished(path: Path) -> None:
    """A ReplayError saying what ``path`` is when it is a bundle's unfinished temporary file
    (its writer's name for it: read, it would only be called truncated)."""
    if (what := describe(path.name)) is not None:
        raise ReplayError(f"{path}: {what}")
