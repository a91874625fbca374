"""The replay's trust rule: where a name recorded in a bundle may be imported from.

A bundle never makes the replay run code by itself. A recorded factory is imported only from a
module under the current directory (the user's project, run where they run it); a recorded loss
class or function also from an installed package (``torch.nn``, a library's losses), since a
loss is part of the training code the user installed. In both cases the object the recorded
path leads to must itself be defined in such a module (``mod:os.system`` leads out of it).
"""

from __future__ import annotations

import importlib.util
import site
import sys
import sysconfig
from pathlib import Path


def under(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
        return True
    except (ValueError, OSError):
        return False


def installed_roots() -> list[Path]:
    """The directories installed packages live in (site-packages, the user site)."""
    roots = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib")}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:  # some virtualenv builds of site lack it
        pass
    user = getattr(site, "getusersitepackages", lambda: None)()
    roots.add(user if isinstance(user, str) else None)
    return [Path(r) for r in roots if r]


def module_origin(name: str) -> str | None:
    """Where the top-level module of ``name`` lives (a file or a package directory), without
    importing it; None for built-in, frozen or missing modules."""
    top = name.split(".")[0]
    loaded = sys.modules.get(top)
    if loaded is not None:
        return getattr(loaded, "__file__", None)
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    origin = found.origin if found and found.has_location else None
    if found is not None and found.submodule_search_locations:
        origin = next(iter(found.submodule_search_locations), origin)
    return origin


def trusted_path(path: str | None, roots: list[Path]) -> bool:
    return path is not None and Path(path).is_absolute() and any(under(Path(path), r)
                                                                 for r in roots)


def defined_in(obj) -> str | None:
    """The file of the module that defines ``obj`` (its ``__module__``), if it is loaded."""
    home = getattr(obj, "__module__", None)
    mod = sys.modules.get(home) if isinstance(home, str) else None
    return getattr(mod, "__file__", None)


def own_code(obj, roots: list[Path]) -> bool:
    """``obj`` is defined in the user's own code: under ``roots`` other than the installed
    packages' directories, and not in an installed package (a virtualenv inside the current
    directory is under it too)."""
    installed = installed_roots()
    where = defined_in(obj)
    return trusted_path(where, [r for r in roots if r not in installed]) \
        and not trusted_path(where, installed)
