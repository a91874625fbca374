"""The directory the run imported its factory's module from, read off the bundle's command line
and working directory (``env.argv``, ``env.cwd``), for the advice of a factory the replay
refuses or cannot import from here: a script run as ``python proj/train.py`` imported
``models`` from ``proj/``, so ``nanreplay`` started where the script was sees no ``models``
(before: 'pass --factory models:make_model', which failed the same way from there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recorder.factory_home import replay_command


def run_home(meta: dict[str, Any], spec: str) -> Path | None:
    """The run's script directory or working directory, the first holding ``spec``'s
    top-level module (``models.py`` or ``models/``) here; None when neither does."""
    env = meta.get("env") or {}
    cwd, argv = env.get("cwd"), env.get("argv")
    if not isinstance(cwd, str):
        return None
    roots = [Path(cwd)]
    if isinstance(argv, list) and argv and isinstance(argv[0], str) \
            and argv[0] not in ("", "-c", "-m"):  # (python -c has no script directory)
        roots.insert(0, (Path(cwd) / argv[0]).parent)
    top = spec.partition(":")[0].split(".")[0]
    for root in roots:
        if (root / f"{top}.py").is_file() or (root / top).is_dir():
            return root.resolve()
    return None


def where_advice(meta: dict[str, Any], spec: str, bundle: Path) -> str | None:
    """What to run instead, when the run imported ``spec``'s module from another directory
    than this one: the ``cd`` there, and, that directory being under this one, the dotted
    ``--factory`` that imports it from here; None otherwise (the generic advice stands)."""
    home = run_home(meta, spec)
    here = Path.cwd().resolve()
    if home is None or home == here:
        return None
    top = spec.partition(":")[0].split(".")[0]
    text = f"the run imported {top} from {home}: run `{replay_command(home, bundle)}`"
    if home.is_relative_to(here) and all(p.isidentifier() for p in home.relative_to(here).parts):
        return text + f", or pass --factory {'.'.join(home.relative_to(here).parts)}.{spec} " \
            "to trust it"
    return text + f", or pass --factory {spec} to trust it, with {home} on PYTHONPATH"
