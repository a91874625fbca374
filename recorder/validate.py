"""Constructor checks of :class:`~recorder.FlightRecorder` on the objects it is given (model,
optimizer, loss, GradScaler, scheduler) and on the paths it names (the output directory, the
factory): every mistake is reported when the recorder is built, in one line saying what, why
and what to do, never at the first event. The settings' own checks are in
:mod:`recorder.settings`, which uses these."""

from __future__ import annotations

import ast
import difflib
import errno
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from .compat import is_grad_scaler, uncompiled
from .scripted import check_not_scripted
from .shards import check_supported
from .unhooked_call import warn_unhooked

log = logging.getLogger("nanreplay")


# Wrappers whose step() ends by calling the optimizer they hold, by the attribute that holds
# it: Lightning's (what a LightningModule's ``self.optimizers()`` returns) and accelerate's
# (``prepare(optimizer)``) and Lightning Fabric's (``fabric.setup``'s ``_FabricOptimizer``, a
# ``FabricAdamW`` no replay can rebuild) as ``.optimizer``; Opacus's DPOptimizer (``make_private``, and its
# per-layer, distributed, AdaClip and ghost-clipping subclasses) as ``.original_optimizer``,
# after it clipped, noised and scaled the per-sample gradients into ``p.grad``: the inner
# optimizer's step hooks see the gradients the update uses
_DELEGATING = {"LightningOptimizer": "optimizer", "AcceleratedOptimizer": "optimizer",
               "_FabricOptimizer": "optimizer", "DPOptimizer": "original_optimizer"}


def torch_optimizer(optimizer):
    """The optimizer a delegating wrapper steps (see ``_DELEGATING``), which the recorder hooks
    and records (the wrapper's own class, ``LightningAdam``, cannot be rebuilt); any other
    optimizer as it is."""
    while optimizer is not None:
        attr = next((_DELEGATING[c.__name__] for c in type(optimizer).__mro__
                     if c.__name__ in _DELEGATING), None)
        inner = getattr(optimizer, attr, None) if attr else None
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


# An optimizer that trains the model's input (style transfer's image) holds no parameter of
# it: the gradient that update takes is checked, and re-run, only for a parameter of the model.
STRAY_INPUT = (
    "; an optimizer that trains the model's input instead (the image of style transfer or "
    "feature visualisation) is recorded with that tensor held in the model: an nn.Parameter "
    "of a module whose forward feeds it to the network (its gradient is then checked and "
    "re-run, a loss given it too), or without the optimizer (optimizer=None), which checks "
    "the image only as the next step's input")


def check_model(model, optimizer, loss_fn=None) -> None:
    """The model is a module (unreplicated; sharded only by FSDP2) and the optimizer holds its
    parameters (and those of ``loss_fn``: a learnable temperature, recorded with the model's)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"FlightRecorder: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}; pass the module whose forward runs the step")
    check_not_scripted(model)
    check_supported(model)  # FSDP2 is recorded; FSDP1 and tensor parallelism are refused
    _check_not_replicated(model)
    _warn_no_forward(model)
    warn_unhooked(model, loss_fn)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"FlightRecorder: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}" + _wrapper_advice(optimizer))
        stray = stray_params(model, optimizer, loss_fn)
        copies = master_copies(model, stray)
        if copies:
            raise ValueError(copies)
        if stray:
            shapes = ", ".join(str(list(p.shape)) for p in stray[:3])
            raise ValueError(f"FlightRecorder: {len(stray)} optimizer parameter(s) are not "
                             f"parameters of the model (shapes {shapes}); build the optimizer "
                             "from this model's parameters()" + STRAY_INPUT)


def stray_params(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn=None) -> list:
    """The optimizer's parameters that are neither the model's nor the loss module's (a
    learnable temperature it may hold), in its groups' order."""
    own = {id(p) for p in model.parameters()}
    if isinstance(loss_fn, nn.Module):
        own |= {id(p) for p in loss_fn.parameters()}
    return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]


def master_copies(model: nn.Module, stray: list) -> str | None:
    """The refusal of an optimizer that holds master copies of the model's weights (float32
    copies of a bfloat16 or float16 model, updated there and copied back by the loop): each
    stray parameter has a model parameter of its shape but another dtype. The recorder's way
    for such a loop is no optimizer (the step checked as its backward ends, before the loop's
    own update), not an optimizer built from the model's parameters, which trains in low
    precision."""
    if not stray:
        return None
    left: dict = {}
    for p in model.parameters():
        left.setdefault(tuple(p.shape), []).append(p.dtype)
    kinds = set()
    for p in stray:
        dtypes = left.get(tuple(p.shape), [])
        other = next((d for d in dtypes if d != p.dtype and d.is_floating_point), None)
        if other is None or not p.dtype.is_floating_point:
            return None
        dtypes.remove(other)
        kinds.add((str(p.dtype).removeprefix("torch."), str(other).removeprefix("torch.")))
    said = ", ".join(f"{a} copies of its {b} parameters" for a, b in sorted(kinds))
    return (f"FlightRecorder: the optimizer's {len(stray)} parameter(s) are not the model's but "
            f"{said} (master weights the loop updates and copies back into the model); "
            "record such a loop without the optimizer: FlightRecorder(model, None, ...) "
            "checks each step as its backward ends, before the update, and writes the bundle "
            "with the model's weights and gradients")


def has_own_forward(model: nn.Module) -> bool:
    """Its class defines ``forward`` (a ``torch.compile`` wrapper's: its module's)."""
    return type(uncompiled(model)).forward is not nn.Module.forward


def _warn_no_forward(model: nn.Module) -> None:
    """A container with no forward of its own (an RL agent holding its actor, critics and
    target critics, which the loop calls one by one) never opens a step: the recorder opens
    one at the recorded model's forward. Said when the recorder is built, not after the first
    update (when only the submodule that ran is named), with what to record instead. A
    ``torch.compile`` wrapper (``OptimizedModule``, whose class has no forward) is judged by
    the module it compiled."""
    if has_own_forward(model):
        return
    model = uncompiled(model)
    parts = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    named = f" ({', '.join(parts[:4])})" if parts else ""
    log.warning("nanreplay: %s has no forward of its own, and the recorder opens a step at the "
                "recorded model's forward: a loop that calls its submodules%s one by one "
                "opens none, and nothing is recorded or checked. Give each network the loop "
                "calls a FlightRecorder of its own, with the optimizer that steps it "
                "(FlightRecorder(agent.critic, critic_optimizer) and "
                "FlightRecorder(agent.actor, actor_optimizer)), or give the container a forward "
                "that runs the step", type(model).__name__, named)


def check_loss_fn(loss_fn) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"FlightRecorder: loss_fn must be callable, got {type(loss_fn).__name__}")


def check_companions(scaler, lr_scheduler) -> None:
    """The GradScaler and the learning-rate scheduler, when given, are what they claim."""
    if scaler is not None and not is_grad_scaler(scaler):
        raise TypeError(f"FlightRecorder: scaler must be a torch.amp.GradScaler, got "
                        f"{type(scaler).__name__}")
    if lr_scheduler is not None and not callable(getattr(lr_scheduler, "state_dict", None)):
        raise TypeError(f"FlightRecorder: lr_scheduler must be a scheduler with a state_dict() "
                        f"(torch.optim.lr_scheduler), got {type(lr_scheduler).__name__}")


def check_factory_kwargs(kwargs, what: str) -> None:
    """``kwargs`` is None or a dict of identifier keys and JSON values (the bundle stores it and
    the replay passes it to the factory); ``what`` starts the one-line error."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier()
                                               for k in kwargs):
        raise TypeError(f"{what} must be a dict of keyword arguments for the factory (names as "
                        f"keys), got {type(kwargs).__name__}: {str(kwargs)[:80]}")
    try:
        json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must hold JSON values only (numbers, strings, booleans, None, "
                        f"lists, dicts), so the bundle can store them ({e})") from None


def _check_not_replicated(model: nn.Module) -> None:
    """``nn.DataParallel`` over several devices copies the model onto each device at every
    forward and runs the copies in threads; the copies share the hook dictionaries, so the
    recorder would see each device's calls as the model's, with statistics on other devices.
    (Over one device, or none, it just calls the module: fine.)"""
    for m in model.modules():
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(f"FlightRecorder: nn.DataParallel over {len(m.device_ids)} devices "
                             "is not supported (it runs a copy of the model per device, in "
                             "threads, every step); use DistributedDataParallel under torchrun "
                             "(one process per device), or record on one device")


def out_dir_path(out_dir) -> Path:
    """``out_dir`` as the directory the user meant: a ``str``, ``bytes`` or ``PathLike`` with
    ``~`` expanded (Python's file functions do not: ``"~/runs"`` was a directory named ``~``
    in the working directory); anything else refused in one line."""
    try:
        path = Path(os.fsdecode(out_dir))
    except TypeError:
        raise TypeError(f"FlightRecorder: out_dir must be a directory path (a str or "
                        f"pathlib.Path), got {type(out_dir).__name__}; pass where bundles go, "
                        f"or leave it out for 'nan-bundles'") from None
    try:
        return path.expanduser()
    except RuntimeError:  # (no home directory to expand '~' to: check_writable names it)
        return path


def check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".nanreplay-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"FlightRecorder: out_dir '{out_dir}' is not writable "
                         f"({why_unwritable(out_dir, e)}); pass a directory this process can "
                         "write") from None


def write_remedy(e: OSError) -> str:
    """What to do about a bundle write that failed with ``e``, by its errno."""
    if e.errno == errno.EFBIG:  # (not the disk: the process's RLIMIT_FSIZE, or the file system's)
        return ("raise the file size limit (ulimit -f, or the job scheduler's), or give the "
                "recorder an out_dir on a file system that takes larger files")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space (or raise the quota), or give the recorder an out_dir with room"
    return "free space or give the recorder an out_dir it can write"


def why_unwritable(out_dir: Path, e: OSError) -> str:
    """Why ``out_dir`` could not be written, in words: mkdir's ``File exists`` and ``Not a
    directory`` do not say that a file stands where the directory should be."""
    for d in (out_dir, *out_dir.parents):
        if d.exists() and not d.is_dir():
            return f"'{d}' is a file, not a directory"
    return e.strerror or str(e)


class TrainsOnImport(RuntimeError):
    """A :class:`~recorder.FlightRecorder` was built while :func:`import_object` imported a
    module: the module trains when imported (its loop not under ``if __name__ ==
    "__main__":``). Raised there, so that nanreplay's import of a factory does not run the
    training again, writing bundles of its own."""


_importing: list[str] = []  # the modules import_object is importing (nested: innermost last)


def check_not_importing() -> None:
    """Called as a recorder is built: refused inside :func:`import_object`'s import."""
    if _importing:
        raise TrainsOnImport(f"importing {_importing[-1]} builds a FlightRecorder (it trains "
                             "when imported); stopped there")


def import_object(module: str, attr: str):
    """``module`` imported, then the dotted ``attr`` looked up in it (a factory's two parts).
    Raises whatever the import or the lookup raises, :class:`TrainsOnImport` where the
    module builds a recorder as it is imported: callers add their own context."""
    _importing.append(module)
    try:
        obj = importlib.import_module(module)
    finally:
        _importing.pop()
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_factory(factory: str) -> None:
    mod, _, fn = factory.partition(":")
    if not mod or not fn:
        raise ValueError(f"FlightRecorder: factory {factory!r} is not of the form "
                         "'module:function' (e.g. 'mypkg.train:make_model')")
    try:
        main = _running_script(mod)
        if main is not None:  # importing it would run the script (the training) a second time
            obj = main
            for part in fn.split("."):
                obj = getattr(obj, part)
            if not _has_main_guard(main.__file__):
                log.warning(
                    "nanreplay: the factory %r is defined in the script being run (%s), whose "
                    "code outside functions is not under `if __name__ == \"__main__\":`; "
                    "nanreplay imports that module to rebuild the model, which would run that "
                    "code (the training) again: put it under the guard", factory,
                    os.path.basename(main.__file__))
        else:
            obj = import_object(mod, fn)
    except Exception as e:
        raise ValueError(f"FlightRecorder: factory {factory!r} cannot be imported "
                         f"({type(e).__name__}: {e}); pass {_near_name(mod, fn, e)}'module:function' "
                         "importable from this process") from None
    if not callable(obj):
        raise ValueError(f"FlightRecorder: factory {factory!r} is not callable")


def _near_name(mod: str, fn: str, e: Exception) -> str:
    """For a misspelt function of a module that imported (``train:make_modle``,
    ``train:make_model()``), its closest name as the factory to pass (Python's own "Did you
    mean" is printed only with a traceback, and this error is one line)."""
    if not isinstance(e, AttributeError):
        return ""
    module = sys.modules.get(mod) or _running_script(mod)
    head, dot, rest = fn.partition(".")
    if module is None or hasattr(module, head):  # (misspelt deeper: an attribute's attribute)
        return ""
    near = difflib.get_close_matches(head, [n for n in dir(module) if not n.startswith("__")],
                                     n=1, cutoff=0.6)
    return f"'{mod}:{near[0]}{dot}{rest}' (the closest name it has), or " if near else ""


def _running_script(module: str):
    """The ``__main__`` module when ``module`` names the script being run (``python train.py``
    with ``factory="train:make_model"``, or ``python -m mypkg.train``) and is not imported
    under its own name yet; else None. Found without importing it."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or module in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec(module)
    except Exception:  # (an unimportable parent package: the import below says why)
        return None
    origin = getattr(spec, "origin", None)
    if not origin or not os.path.exists(origin):
        return None
    try:
        return main if os.path.samefile(origin, path) else None
    except OSError:  # (the script moved since it started: nothing to compare)
        return None


# the training script's module names: multiprocessing's spawn (``torch.multiprocessing.spawn``)
# runs the parent's script again in each child as ``__mp_main__``, whose classes and functions
# carry that name, which no replay can import
SCRIPT_MODULES = ("__main__", "__mp_main__")


def script_module() -> str | None:
    """The name that imports the script running as ``__main__`` (its ``python -m`` name, else
    its file's stem: ``python train.py`` puts its directory first on the path), when its code
    outside functions is under the ``__main__`` guard, so that importing it runs no training;
    else None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return None
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None and spec.name != "__main__" else Path(path).stem
    if not all(part.isidentifier() for part in name.split(".")) or not _has_main_guard(path):
        return None
    return name


def _has_main_guard(path: str) -> bool:
    """The script has a top-level ``if __name__ == "__main__":`` (either way round)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return True  # (unknown: say nothing)
    for node in tree.body:
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.comparators) == 1:
            sides = [test.left, test.comparators[0]]
            names = {n.id for n in sides if isinstance(n, ast.Name)}
            consts = {n.value for n in sides if isinstance(n, ast.Constant)}
            if names == {"__name__"} and consts == {"__main__"}:
                return True
    return False


def _wrapper_advice(optimizer) -> str:
    """What to pass for an object that is no optimizer: None, and for a wrapper holding one
    as an attribute (schedule_free's ScheduleFreeWrapper, ``.base``), how to record it: its
    step() may move the weights around the inner one's (that wrapper swaps z into them), so
    hooking the inner step() would check the step after that move."""
    try:
        held = [k for k, v in vars(optimizer).items() if isinstance(v, torch.optim.Optimizer)]
    except TypeError:
        held = []
    if not held:
        return _builder_advice(optimizer) or "; pass None for loops without one"
    return (f", which holds one as .{held[0]}: a wrapper whose step() does more than call it "
            "(schedule_free's ScheduleFreeWrapper moves the weights around base.step()) is "
            "recorded with optimizer=None and rec.end_step() after backward, before its "
            f"step(); for one whose step() only calls it, pass .{held[0]}")


def _builder_advice(optimizer) -> str | None:
    """For an object holding an optimizer class rather than an optimizer, which builds its own
    at each step (Pyro's ``pyro.optim.Adam``: one ``torch.optim.Adam`` per parameter, made
    lazily inside ``SVI.step``): build that class over the model's parameters and step it."""
    try:
        held = [v for v in vars(optimizer).values()
                if isinstance(v, type) and issubclass(v, torch.optim.Optimizer)]
    except TypeError:
        return None
    if not held:
        return None
    mod = held[0].__module__
    cls = f"{'torch.optim' if mod.startswith('torch.optim.') else mod}.{held[0].__qualname__}"
    return (f", which builds its own {cls} optimizers as it steps: build one over the model's "
            f"parameters and step it in the loop (Pyro: loss = Trace_ELBO()"
            ".differentiable_loss(model, guide, *args); loss.backward(); optimizer.step(), "
            "with a module holding model and guide given to the recorder)")
