"""The model factory a replay calls: the trust rule for a recorded one (``resolve_factory``) and
the command line it is imported with (``recorded_argv``)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from recorder.validate import TrainsOnImport, import_object

from .errors import FactoryRefused, ReplayError
from .trust import defined_in, module_origin, trusted_path


def resolve_factory(spec: str, *, explicit: bool, where: str | None = None) -> Any:
    """The callable named by ``module:function``.

    A recorded (not ``explicit``) factory is refused unless its top-level module is found
    under the current directory, so a bundle from elsewhere cannot make us import code.
    ``where``: the advice naming the directory the run imported it from (``run_home``), for
    a refusal or a failed import.
    """
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ReplayError(f"factory {spec!r} is not of the form 'module:function'; "
                          "pass --factory mypkg.train:make_model")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if not explicit and not trusted_path(module_origin(mod_name), [Path(cwd)]):
        raise FactoryRefused(
            f"the bundle's factory {spec!r} is not a module under the current directory "
            f"({cwd}); nanreplay imports a recorded factory only from there"
            + (f"; {where}" if where else ". Run from the directory that holds the factory's "
               f"module, or pass --factory {spec} to trust it"))
    try:
        obj = import_object(mod_name, attr)
    except TrainsOnImport:
        raise ReplayError(
            f"factory {spec!r}: importing {mod_name} runs its training (a FlightRecorder is "
            "built at import), which nanreplay stopped there; put the training under `if "
            "__name__ == \"__main__\":`, or pass --factory MOD:FN of a module that only "
            "builds the model") from None
    except Exception as e:
        raise ReplayError(f"factory {spec!r} cannot be imported ({type(e).__name__}: {e}); "
                          + (_shadowed(mod_name, attr, Path(cwd)) or where
                             or "run from the directory that holds it or pass --factory MOD:FN")
                          ) from None
    if not callable(obj):
        raise ReplayError(f"factory {spec!r} is not callable; pass --factory MOD:FN, a "
                          "function that returns the model")
    if not explicit:
        # The attribute path may lead out of the trusted module ('mod:os.fork', 'mod:torch.x'):
        # call only what is defined in a module under cwd as well.
        home = getattr(obj, "__module__", None)
        if not trusted_path(defined_in(obj), [Path(cwd)]):
            raise FactoryRefused(
                f"the bundle's factory {spec!r} is {home}.{getattr(obj, '__qualname__', '?')}, "
                f"which is not defined under the current directory ({cwd}); nanreplay calls a "
                f"recorded factory only from there. Pass --factory {spec} to trust it")
    return obj


def _shadowed(mod_name: str, attr: str, cwd: Path) -> str | None:
    """How to import ``mod_name`` when its top-level name is a directory under ``cwd`` without
    ``__init__.py`` (a namespace package) that an installed regular package of the same name
    takes precedence over, wherever ``sys.path`` puts ``cwd`` (opacus and pytorch-forecasting
    install a top-level ``examples``); None otherwise."""
    top, _, rest = mod_name.partition(".")
    local = cwd / top
    if not rest or not local.is_dir() or (local / "__init__.py").exists():
        return None
    origin = module_origin(top)
    if origin is None or trusted_path(origin, [cwd]):
        return None
    return (f"the {top!r} imported is {origin}, an installed package, which Python prefers to "
            f"./{top}/ (a directory without __init__.py): run from {local} and pass --factory "
            f"{rest}:{attr}, or add an __init__.py to ./{top}/")


@contextlib.contextmanager
def recorded_argv(meta: dict[str, Any], spec: str):
    """The user's code imported and called with the command line the run had (``env.argv``),
    not nanreplay's: a module that parses ``sys.argv`` when imported (a module-level
    ``parser.parse_args()``) read the bundle's path and nanreplay's options, and failed with
    its own usage message or took them for its arguments. Its ``SystemExit`` (argparse's, a
    ``sys.exit`` at import) is a one-line error instead of ending nanreplay without one."""
    argv = (meta.get("env") or {}).get("argv")
    saved = sys.argv
    recorded = isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
    sys.argv = list(argv) if recorded else saved[:1]
    try:
        yield
    except SystemExit as e:
        raise ReplayError(
            f"factory {spec!r}: the code it imports or calls exited (SystemExit({e.code!r})) "
            f"with the recorded command line {sys.argv!r}; move what parses the command line "
            "or exits under `if __name__ == \"__main__\":`, or pass --factory MOD:FN of a "
            "module that does neither when imported") from None
    finally:
        sys.argv = saved
