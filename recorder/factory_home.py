"""Where ``nanreplay`` must run for the factory's module to import: the directory the training
process imported it from. A script run from another directory (``python proj/train.py`` with
``factory="models:make_model"``, models.py beside the script) imports its own directory's
modules, which ``nanreplay`` run where the script was started does not, so the event's
message and the replay's note give the command that works: ``cd proj && nanreplay ...``.
"""

from __future__ import annotations

import os
import shlex
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any


def needs_model(meta: dict[str, Any]) -> bool:
    """The replay must build the model to show the event: not an ``input`` or ``weights``
    event, which the bundle's batch or weights show alone (under torch.distributed, the event
    of the rank that saw it first, which every rank's bundle replays)."""
    event = meta.get("event") or {}
    phase = (event.get("ranks") or {}).get("first_phase") or event.get("phase")
    return phase not in ("input", "weights")


def factory_spec(meta: dict[str, Any]) -> str | None:
    """The ``module:function`` the replay will import: the recorded factory, else the model's
    class called with the arguments it kept or bare (``snapshot._without_factory``)."""
    model = meta.get("model") or {}
    init = model.get("init") or {}
    for spec in (meta.get("factory"), init.get("class") if init.get("args") else None,
                 model.get("default_factory")):
        if isinstance(spec, str) and ":" in spec:
            return spec
    return None


def imported_from(spec: str) -> Path | None:
    """The ``sys.path`` directory this process imported ``spec``'s top-level module from (the
    training script itself when it is that module, run as ``__main__``); None when unknown."""
    top = spec.partition(":")[0].split(".")[0]
    file = getattr(sys.modules.get(top), "__file__", None)
    if file is None:
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if main is None or Path(main).stem != top:
            return None
        file = main
    found = Path(file).resolve()
    home = found.parent.parent if found.name == "__init__.py" else found.parent
    return None if _installed(home) else home  # (the replay's trust rule refuses those anyway)


def _installed(home: Path) -> bool:
    """``home`` is an installed packages' directory (site-packages, the user site)."""
    roots = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    roots.append(getattr(site, "getusersitepackages", lambda: None)())
    return any(isinstance(r, str) and Path(r).resolve() == home for r in roots)


def replay_command(home: Path, bundle: Path | str) -> str:
    """``cd DIR && nanreplay BUNDLE``: DIR from the current directory, BUNDLE from DIR, each
    relative where that climbs at most one directory (``cd proj && nanreplay ../runs/x.nan``),
    else absolute."""
    where = _short(home, Path.cwd().resolve())
    return f"cd {shlex.quote(where)} && nanreplay {shlex.quote(_short(Path(bundle), home))}"


def _short(path: Path, start: Path) -> str:
    rel = os.path.relpath(path.resolve(), start)
    return str(path.resolve()) if rel.startswith(os.path.join(os.pardir, os.pardir)) else rel


def run_there(msg: str, path: Path, meta: dict[str, Any]) -> str:
    """``msg`` with its ``nanreplay PATH`` advice given the ``cd`` to the factory's directory,
    when the training process imported the factory's module from another directory than the
    current one (where the replay refuses it)."""
    spec = factory_spec(meta) if needs_model(meta) else None
    home = imported_from(spec) if spec else None
    if home is None or home == Path.cwd().resolve():
        return msg
    top = spec.partition(":")[0].split(".")[0]
    return msg.replace(
        f"run `nanreplay {path}`",
        f"run `{replay_command(home, path)}` (nanreplay imports the factory's module {top} "
        "only from under the directory it runs in)")
