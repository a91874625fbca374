"""Gradient hooks the model's own code registers (``h.register_hook(fn)`` in a forward: a
per-sample gradient normalisation, a gradient reversal's scale, a clamp of the gradient).

The engine runs such a hook on the gradient before the node that consumes it, outside every
node, so a NaN the hook makes shows as a node's non-finite *incoming* gradient and no node is
found to have made it (anomaly mode blames the next node). :class:`HookWatch`, active in the
re-run's forward, wraps each hook registered there: the first one given a finite gradient that
returns (or leaves, editing it in place) a non-finite one is kept, with the aten op of its own
code that made the value.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from recorder.finite import finite, kind_of
from recorder.samples import Samples

from .compat import grad_hooks
from .hooked_module import FULL, PRE
from .ops import OpFinder, OpHit
from .source import OP_ERROR, short_path, user_source

# what the report calls the place the value was made, in place of a backward node's name
HOOK = "a gradient hook"
MODULE_HOOK = "a module backward hook"
# the node whose post-hooks run a module's register_full_backward_hook hooks (its own
# backward passes the gradient on unchanged)
MODULE_HOOK_NODE = "BackwardHookFunctionBackward"


@dataclass
class HookHit:
    registered: str | None  # file:line of the register_hook call (a parameter's: the hook's)
    node: int | None  # id() of the hooked tensor's autograd node (None: a leaf), for its module
    made: str
    dtype: torch.dtype
    samples: list[int]
    op: OpHit | None  # the op of the hook's code that made it (None: not seen as an op)
    when: tuple = ()  # what ``now()`` said as it ran (the re-run's micro-batch)
    param: str | None = None  # the parameter it is on (its gradient has no samples)
    module_hook: bool = False  # a module's register_full_backward_hook hook


class _Register(TorchFunctionMode):
    def __init__(self, watch: HookWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.register_hook and len(args) == 2 and callable(args[1]):
            tensor, hook = args
            args = (tensor, self.watch.wrap(hook, tensor, user_source()))
        try:
            return func(*args, **kwargs)
        except Exception as e:  # the model's call failing (autograd.grad in anomaly mode),
            setattr(e, OP_ERROR, True)  # not the replay: this frame is the mode's
            raise


class HookWatch:
    """``taken()`` says whether something else (a node) made a non-finite value first;
    ``now()`` where the run is (kept with the hit)."""

    def __init__(self, where: Samples, taken, now=tuple):
        self.where, self.taken, self.now = where, taken, now
        self.hit: HookHit | None = None

    @contextlib.contextmanager
    def registering(self):
        """The forward's context: hooks registered inside it are watched."""
        with _Register(self):
            yield

    def parameters(self, model: torch.nn.Module) -> list:
        """Watch the hooks the model's parameters carry (registered when it was built); the
        handles returned put the hooks back."""
        handles = []
        for name, p in model.named_parameters():
            hooks = grad_hooks(p)
            for key, hook in list(hooks.items()):
                hooks[key] = self.wrap(hook, p, _defined(hook), param=name)
                handles.append(_Restore(hooks, key, hook))
        return handles

    def wrap(self, hook, tensor: torch.Tensor, registered: str | None,
             param: str | None = None):
        # (its id: a reference from the hook, which the node holds, would keep the graph)
        node = id(tensor.grad_fn) if tensor.grad_fn is not None else None

        def watched(grad):
            if self.hit is not None or self.taken() or not isinstance(grad, torch.Tensor) \
                    or not finite(grad):
                return hook(grad)
            finder = OpFinder(self.where)
            with finder:
                out = hook(grad)
            got = out if isinstance(out, torch.Tensor) else grad  # (None: edited in place)
            if not finite(got):
                self.hit = HookHit(registered, node, kind_of(got), got.dtype,
                                   [] if param else self.where.rows(got), finder.origin(),
                                   self.now(), param)
            return out

        return watched


class _Restore:
    def __init__(self, hooks: dict, key, hook):
        self.hooks, self.key, self.hook = hooks, key, hook

    def remove(self) -> None:
        if self.key in self.hooks:
            self.hooks[self.key] = self.hook


def _defined(hook) -> str | None:
    """``file:line`` where ``hook`` is defined (a lambda: where it was registered, often)."""
    code = getattr(hook, "__code__", None)
    return f"{short_path(code.co_filename)}:{code.co_firstlineno}" if code else None


def module_hook_hit(origin, op: OpHit) -> HookHit:
    """A module backward hook's hit: ``origin`` found its node (``MODULE_HOOK_NODE``) and
    ``op`` is the op its hooks made the value with."""
    return HookHit(None, None, origin.made, origin.dtype, origin.samples, op,
                   (origin.micro_batch, origin.in_loss), module_hook=True)


def hook_hint(origin, hint: str) -> str:
    """The cause's hint of ``origin`` (a :class:`~replay.backward.BackwardOrigin` whose
    ``hook`` is set), said of the hook: its code is what to fix, not the forward's."""
    hit = origin.hook
    if hit.module_hook:
        kind = "pre-hook" if origin.hook_kind == PRE else "hook"
        return (f"a backward {kind} of module {origin.module or '<root>'} "
                f"({origin.hook_kind or FULL}) turned a finite gradient into {origin.made}; "
                f"in the hook: {hint}")
    at = f" {'defined' if hit.param else 'registered'} at {hit.registered}" \
        if hit.registered else ""
    on = f" on parameter {hit.param}" if hit.param else ""
    return (f"{HOOK}{on}{at} (tensor.register_hook) turned a finite gradient into {origin.made} "
            f"before any backward node ran on it; in the hook: {hint}")


def hook_fields(origin, fields: dict) -> dict:
    """A backward origin's report fields when a hook made the value: its op "of a gradient
    hook (registered at)", as a derivative's op is named "of" its node."""
    op = origin.hook.op
    return {**fields, "op": op.op if op is not None else None,
            "node": MODULE_HOOK if origin.hook.module_hook else HOOK,
            "node_source": origin.hook.registered, "chain": [op.as_json()] if op else []}
