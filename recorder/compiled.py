"""``torch.compile``'d models: their names as written, and where the recorder's hooks may go.

A compiled region is a module wrapped by ``torch.compile(m)`` (an ``OptimizedModule`` holding
``m`` as ``_orig_mod``; ``torch.compiler.disable(m)`` makes one too, to run ``m`` eagerly: its
module is hooked as an eager one), compiled in place by ``m.compile()``, or whose ``forward`` was replaced
by a compiled one. Dynamo traces the hooks of the modules inside it into its graphs, where the
recorder's Python (its records, counters, weak references, locks) would break the graph at every
layer or be replayed wrongly. So a region is recorded as one call, its hooks run outside the
graph (on the compiled module, disabled for dynamo: compiled code calling a wrapper, such as a
compiled training step, runs the module's graph without the wrapper's own hooks), and the
modules inside it are not hooked: their per-layer statistics are
what ``nanreplay`` finds when it re-runs the step eagerly.

Names leave out the wrappers (``blocks.1._orig_mod.fc.weight`` is ``blocks.1.fc.weight``), so a
bundle fits the model its factory builds, compiled or not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from .compat import (
    WRAPPER,
    compiled_function,
    compiled_in_place,
    compiled_module,
    compiles,
    dynamo_disabled,
    forget_compiled_code,
    forget_every_compiled_code,
    frame_compiled,
    is_compile_wrapper,
    uncompiled,
    undo_in_place_compile,
)
from .scripted import is_scripted


def eager_name(name: str) -> str:
    """``name`` without the compile wrappers' ``_orig_mod`` parts."""
    if WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != WRAPPER)


@dataclass
class HookSite:
    """One module of the model as written, and where its hooks go."""

    name: str
    module: nn.Module
    target: nn.Module | None  # None: inside a compiled region, not hooked
    region: bool = False  # a compiled region, recorded as one call
    disable: bool = False  # its hooks run where dynamo would trace them: registered disabled


def hook_sites(root: nn.Module, wrapper: nn.Module | None = None,
               compiled_elsewhere: bool = False) -> list[HookSite]:
    """Every module under ``root`` (the model as written, see :func:`unwrap`; ``wrapper``: the
    compile wrapper around it) in ``named_modules`` order, wrappers left out.
    ``compiled_elsewhere``: ``root`` runs under a compile wrapper that is not at hand (one a
    Trainer made): it is a region whose hooks are registered disabled."""
    sites: list[HookSite] = []
    wrappers: dict[int, nn.Module] = {id(root): wrapper} if wrapper is not None else {}
    # names of the compiled regions and scripted modules met so far (ancestors come first)
    regions: list[str] = []
    for raw, m in root.named_modules():
        if is_compile_wrapper(m):
            if compiles(m):  # (torch.compiler.disable's wrapper: its module runs eagerly)
                wrappers[id(compiled_module(m))] = m
            continue
        name = eager_name(raw)
        scripted = is_scripted(m)  # (no hooks on it, nor on what it holds: recorder.scripted)
        if scripted or any(name.startswith(r + ".") if r else name != "" for r in regions):
            if scripted:
                regions.append(name)
            sites.append(HookSite(name, m, None))
            continue
        # (a wrapper's module is hooked, not the wrapper: compiled code calling the wrapper, a
        # compiled training step, runs the module's graph without the wrapper's hooks)
        if wrappers.get(id(m)) is not None or compiled_in_place(m) \
                or (compiled_elsewhere and m is root):
            sites.append(HookSite(name, m, m, region=True, disable=True))
        else:
            sites.append(HookSite(name, m, m))
        if sites[-1].region:
            regions.append(name)
    return sites


def compile_with_hooks(root: nn.Module, wrapper: nn.Module | None) -> None:
    """After the recorder's hooks are registered: code dynamo compiled before runs the model's
    modules without them, as it guards on no module hook (see
    :func:`~recorder.compat.forget_compiled_code`). Not only a compile wrapper's, shared by
    every ``torch.compile(module)``, the recorder not given one (the loop compiled its own copy
    of the model), but a compiled training step's that traced the model in: the same step
    function run before in this process (a run without the recorder, an earlier fold, a
    notebook cell run again), whose forward the recorder then never saw. So every frame dynamo
    compiled compiles again at its next call, with them (once, at attach); a process that
    compiled nothing has nothing to drop."""
    if forget_every_compiled_code() is not None:
        return
    for m in [wrapper, *root.modules()]:
        if m is not None and is_compile_wrapper(m):
            forget_compiled_code(m)


# Module wrappers whose forward only sets a context (autocast, input and output casts) around
# the call of the module they hold, by the attribute that holds it: Lightning Fabric's
# ``fabric.setup(model)`` (``_FabricModule``, its precision's autocast around
# ``_forward_module``; over DDP that is the DDP wrapper, unwrapped next). Their contexts are
# on when the inner module's hooks run, so the recorder records the inner module as the
# model: its names are the factory's (no ``_forward_module.`` prefix)
_PASS_THROUGH = {"_FabricModule": "_forward_module"}


def _pass_through(model: nn.Module) -> nn.Module | None:
    attr = next((_PASS_THROUGH[c.__name__] for c in type(model).__mro__
                 if c.__name__ in _PASS_THROUGH), None)
    inner = getattr(model, attr, None) if attr else None
    return inner if isinstance(inner, nn.Module) and inner is not model else None


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None, weakref.ref | None]:
    """(the model as written, the outermost compile wrapper, a weak reference to the
    DistributedDataParallel that wraps it or None) for a model that ``torch.compile``, DDP,
    DataParallel or a pass-through wrapper (``_PASS_THROUGH``: Fabric's) may wrap, in any
    order. (The DDP itself is read at an event: its communication hooks, recorder.comm_hooks.)"""
    wrapper, ddp = None, None
    while True:
        if is_compile_wrapper(model):
            if compiles(model):  # everything under the outermost one is traced
                wrapper = wrapper or model
            model = compiled_module(model)
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            if ddp is None and isinstance(model, nn.parallel.DistributedDataParallel):
                ddp = weakref.ref(model)
            model = model.module
        elif (inner := _pass_through(model)) is not None:
            model = inner
        else:
            return model, wrapper, ddp


def decompile(model: nn.Module) -> nn.Module:
    """The same model run eagerly: compile wrappers replaced by what they wrap, in-place
    compilation undone (the replay instruments every layer, which a graph would hide)."""
    model = uncompiled(model)
    for m in list(model.modules()):
        if compiled_in_place(m):
            undo_in_place_compile(m)
        for child_name, child in list(m.named_children()):
            if is_compile_wrapper(child):
                setattr(m, child_name, decompile(child))
    return model


def compiled_loss(loss: nn.Module | None) -> bool:
    """The loss the recorder was given is ``torch.compile``'d: a wrapped or in-place compiled
    loss module, or a compiled function (held by the recorder's module around a function, as
    ``fn``). An event in it names no region of the model, but the replay runs it eagerly too."""
    if loss is None:
        return False
    if is_compile_wrapper(loss) and compiles(loss) or compiled_in_place(loss):
        return True
    return type(loss).__name__ == "_CallableLoss" and compiled_function(getattr(loss, "fn", None))


def forward_compiled_alone(model: nn.Module) -> bool:
    """The model's class ``forward`` was compiled as a frame of its own while the model holds
    no compiled forward: the loop calls ``torch.compile(model.forward)`` itself, which skips
    ``nn.Module.__call__`` and with it the root's hooks, so no step's forward is recorded
    (dynamo traces the submodules' hooks into its graph, where they record nothing)."""
    if is_compile_wrapper(model) or compiled_in_place(model):
        return False
    return frame_compiled(getattr(type(model), "forward", None))


def disabled(hook):
    """``hook`` run eagerly when dynamo meets it (inside a compiled region's own call)."""
    return dynamo_disabled(hook)
