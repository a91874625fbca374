"""Modules whose class replaces ``nn.Module.__call__`` with one that runs ``forward`` itself
(GPyTorch's ``gpytorch.Module.__call__``, under every ``ExactGP``, kernel, likelihood and
``MarginalLogLikelihood``): torch's module hooks never run for them, so the recorder given such a
model opens no step and checks nothing, and such a ``loss_fn`` is never seen. Said when the
recorder is built, with what to record instead."""

from __future__ import annotations

import inspect
import logging

from torch import nn
from torch.utils import checkpoint

log = logging.getLogger("recorder")


def bypassing_class(module) -> type | None:
    """The class whose ``__call__`` the module's call ends in without reaching
    ``nn.Module.__call__`` (a ``__call__`` that delegates names ``__call__`` in its code:
    ``super().__call__(...)``), or None when the call reaches torch's (and its hooks). A
    decorated ``__call__`` is read through its ``__wrapped__`` chain (Keras 3's
    ``Layer.__call__`` under ``traceback_utils.filter_traceback``, whose wrapper names no
    ``__call__`` while the method it wraps ends in ``super().__call__``)."""
    if not isinstance(module, nn.Module):
        return None
    for cls in type(module).__mro__:
        if cls is nn.Module:
            return None
        call = cls.__dict__.get("__call__")
        if call is None:
            continue
        code = getattr(unwrapped(call), "__code__", None)
        if code is None or not _delegates(cls, code):
            return cls
    return None


def _delegates(cls: type, code) -> bool:
    """``code`` (a class's ``__call__``) names ``__call__``, or calls an object the class holds
    whose own ``__call__`` does: torch.fx's ``GraphModule`` calls ``self._wrapped_call(...)``,
    whose ``__call__`` ends in ``super().__call__``. (Plain functions and methods it names are
    not followed: GPyTorch's ``__call__`` calls ``self.forward``.)"""
    if "__call__" in code.co_names:
        return True
    for name in code.co_names:
        held = inspect.getattr_static(cls, name, None)
        if held is None or inspect.isroutine(held) or isinstance(
                held, (staticmethod, classmethod, property, type)):
            continue
        call = inspect.getattr_static(type(held), "__call__", None)
        inner = getattr(unwrapped(call), "__code__", None)
        if inner is not None and "__call__" in inner.co_names:
            return True
    return False


def unwrapped(call):
    """The function a ``functools.wraps`` decorator chain ends in (the call itself if none, or
    if the chain loops)."""
    try:
        return inspect.unwrap(call)
    except ValueError:
        return call


def warn_unhooked(model, loss_fn=None) -> None:
    """Warn when the recorded model, or the loss module, is called without torch's hooks."""
    for what, module, seen in (("model", model, "no step opens and nothing is recorded or "
                                "checked"),
                               ("loss_fn", loss_fn, "its loss is neither checked nor re-run")):
        cls = bypassing_class(module)
        if cls is None:
            continue
        log.warning(
            "nanreplay: the %s %s is called through %s.%s.__call__, which runs forward without "
            "torch's module hooks: the recorder sees none of its calls, so %s. Record a torch module whose forward calls it "
            "instead (for a GP, an nn.Module holding the model and the marginal log likelihood "
            "whose forward returns -mll(model(x), y)), with the optimizer over its parameters; "
            "a fitting routine that calls the model or the loss itself, with no torch "
            "optimizer (BoTorch's fit_gpytorch_mll: scipy's L-BFGS-B), must be given a closure "
            "that calls that module instead (fit_gpytorch_mll(mll, closure="
            "ForwardBackwardClosure(forward=lambda: step(x, y), parameters=dict(step."
            "named_parameters()))), else it runs unrecorded",
            what, type(module).__name__, cls.__module__, cls.__qualname__, seen)


def unrooted_reason(root) -> str | None:
    """Why the root's submodules run with no call of the root, where the stack says: the
    root's ``forward`` running, but not under its ``__call__`` (``"forward"``: the loop called
    ``model.forward(x)`` itself, PyTorch's forward-forward example's ``self.forward(x_pos)``,
    which runs no hook), or ``torch.utils.checkpoint.checkpoint_sequential`` given the root
    (``"checkpoint_sequential"``: it calls the Sequential's children one by one); else None.
    Read once, when a submodule first runs outside a step (see ``StepCycle.outside_step``)."""
    code = getattr(getattr(type(root), "forward", None), "__code__", None)
    sequential = getattr(inspect.unwrap(checkpoint.checkpoint_sequential), "__code__", None)
    frame = inspect.currentframe()
    while frame is not None:
        if code is not None and frame.f_code is code and frame.f_locals.get("self") is root:
            caller = frame.f_back
            return "forward" if caller is None or caller.f_code.co_name not in _CALL_FRAMES \
                else None
        if frame.f_code is sequential and _runs(frame.f_locals.get("functions"), root):
            return "checkpoint_sequential"
        frame = frame.f_back
    return None


def _runs(functions, root) -> bool:
    """``checkpoint_sequential``'s ``functions`` is the root, or the list of its children it
    made of it."""
    return functions is root or (isinstance(functions, list) and len(functions) > 0
                                 and functions[0] is next(root.children(), None))


UNROOTED_WHY = {
    "forward": "the loop calls its forward itself (model.forward(x)), which runs no hooks, so "
               "nothing is recorded or checked. Call the model, model(x), as nn.Module expects",
    "checkpoint_sequential": (
        "the loop runs it through torch.utils.checkpoint.checkpoint_sequential(model, ...), "
        "which calls its children one by one and never the model itself, so nothing is "
        "recorded or checked. Record a module whose forward calls "
        "checkpoint_sequential(self.body, segments, x) on the Sequential, and call that module"),
}


# the frames of nn.Module.__call__ that run a forward with its hooks
_CALL_FRAMES = frozenset({"_call_impl", "_wrapped_call_impl", "inner"})
