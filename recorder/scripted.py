"""TorchScript modules (``torch.jit.script`` / ``torch.jit.trace`` of an ``nn.Module``), on
which PyTorch registers no hooks (``register_forward_hook is not supported on
ScriptModules``): the recorder and the replay hook every other module and leave a scripted one,
and all it holds, unhooked. Its ops still run through the dispatcher, where the replay's op
finder sees them; its output is checked as the input of the next hooked call, its parameters'
gradients and weights as every other's. A scripted root, whose call opens a step, is refused
when the recorder is built."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook


def is_scripted(m: object) -> bool:
    return isinstance(m, torch.jit.ScriptModule)


def hookable_modules(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules(prefix=...)`` without the scripted modules and what they hold."""
    inside: list[str] = []
    for name, m in model.named_modules(prefix=prefix):
        if any(not s or name == s or name.startswith(s + ".") for s in inside):
            continue
        if is_scripted(m):
            inside.append(name)
            continue
        yield name, m


def hook_scripted(top: nn.Module, prefix: str, enter: Callable[..., None],
                  leave: Callable[..., None]) -> list:
    """``enter(name, module, args)`` and ``leave(name, module, args, output)`` around each
    call of ``top``'s outermost scripted modules (named under ``prefix``), which take no hooks
    of their own: PyTorch's global module hooks run for a ScriptModule called from Python.
    Nothing is registered when ``top`` holds none."""
    names = {id(m): n for n, m in top.named_modules(prefix=prefix) if is_scripted(m)}
    names = {i: n for i, n in names.items()
             if not any(n.startswith(o + ".") for o in names.values())}
    if not names:
        return []

    def pre(module, args):
        if (name := names.get(id(module))) is not None:
            enter(name, module, args)

    def post(module, args, output):
        if (name := names.get(id(module))) is not None:
            leave(name, module, args, output)
    return [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]


def scripted_in(model: nn.Module, name: str) -> list[str]:
    """The outermost scripted modules inside the module ``name`` of ``model``, unhooked calls
    whose ops the replay names at that module's call."""
    try:
        top = model.get_submodule(name)
    except AttributeError:
        return []
    out: list[str] = []
    for sub, m in top.named_modules(prefix=name):
        if sub != name and is_scripted(m) and not any(sub.startswith(o + ".") for o in out):
            out.append(sub)
    return out


def script_function_home(fn: object) -> tuple[str, str] | None:
    """``(module, name)`` where a ``torch.jit.script``ed function was defined, whose
    ``__module__`` and ``__qualname__`` are its class's (``torch.jit.ScriptFunction``): its
    qualified name is ``__torch__.<module>.<name>``, with no module for ``__main__``'s."""
    if not isinstance(fn, torch.jit.ScriptFunction):
        return None
    name = fn.name
    module = fn.qualified_name.removeprefix("__torch__.").removesuffix(name).rstrip(".")
    return module or "__main__", name


def check_not_scripted(model: nn.Module) -> None:
    if is_scripted(model):
        raise TypeError(
            f"FlightRecorder: the model is a TorchScript module ({type(model).__name__}), on "
            "which PyTorch allows no hooks, so no step can be recorded; record the eager "
            "nn.Module (script or trace it for deployment, after training), or keep only "
            "its submodules scripted: those run unhooked inside a recorded model")
