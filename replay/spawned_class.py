"""A model class of a training script run under multiprocessing's spawn
(``torch.multiprocessing.spawn``, ``mp.Process`` with the spawn start method): each child runs
the script again as ``__mp_main__``, so the bundle records the class as ``__mp_main__.Net``,
which no import reaches. When its ``__init__`` takes arguments the replay cannot call it bare,
and the advice was the generic "pass --factory MOD:FN"; the child's command line (``env.argv``)
names the script, so the advice names the module to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PREFIX = "__mp_main__."


def spawned_advice(meta: dict[str, Any]) -> str | None:
    """What to pass to re-run a step whose model's class the spawned script defined; None for
    any other class, or when the recorded command line names no script."""
    cls = (meta.get("model") or {}).get("class") or ""
    name = cls.removeprefix(PREFIX) if isinstance(cls, str) else ""
    argv = (meta.get("env") or {}).get("argv")
    if not cls.startswith(PREFIX) or "<locals>" in name or not isinstance(argv, list) \
            or not argv or not isinstance(argv[0], str) or not argv[0].endswith(".py"):
        return None
    script = Path(argv[0])
    mod = script.stem if script.stem.isidentifier() else "MOD"
    return (f"the model's class {name} was defined in the script {script.name}, run as "
            f"__mp_main__ in a process multiprocessing's spawn started, and calling it with no "
            f"arguments cannot rebuild it: pass --factory {mod}:FN, a function in "
            f"{script.name} returning the model as the run built it ({name}(...)), from the "
            "script's directory, to re-run the step")
