"""Every private PyTorch API the replay uses, in one module, so a torch upgrade touches one file.

- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the op finder, the float64 mode and
  the op capture watch every aten op through it (:mod:`replay.ops`);
- ``tree_leaves`` / ``tree_map`` (``torch.utils._pytree``): traversals of aten arguments and of
  the plain lists, tuples and dicts a bundle's trees rebuild into;
- :func:`version`: a tensor's in-place version counter (``_version``), so a value computed
  from a tensor is reused only while the tensor is unmodified;
- :func:`running_node`: the autograd node running an op (``_current_autograd_node``);
- ``TorchDispatchMode`` is torch's, made to hand its subclasses autograd's efficient zeros
  (``_is_zerotensor``, :func:`holds_no_data`) as real zeros: a second derivative's formulas
  make them (``hvp``'s double backward), and a kernel reading one inside a mode has no storage
  to read (``aminmax`` raises, ``isfinite`` crashes the process);
- :func:`saved_value`: a value an autograd node saved (``_saved_*``), unless unpacking it
  would recompute a checkpointed region (``_raw_saved_*.unpack_hook``);
- :func:`writes_arguments`: whether an aten op writes into an argument (``func._schema``);
  :func:`returns_view`: whether it returns a view of one;
- :func:`set_parameter`, :func:`set_buffer`, :func:`remove_member`: an ``nn.Module``'s
  parameter, buffer and submodule tables (``_parameters``, ``_buffers``, ``_modules``), written
  directly to assign the bundle's tensors without a copy and to clear what a default
  construction put there; :func:`parameter_like`: a parameter of a subclass of
  ``nn.Parameter`` made around a tensor (``Tensor._make_subclass``);
- :func:`written_places`, :func:`returns_values`: which arguments an op writes, by position
  and name, and whether it returns anything (``func._schema``);
- :func:`custom_op_kernel`: the Python function a ``torch.library.custom_op`` runs for a
  device (``torch._library.custom_ops.OPDEFS``), re-run under an op finder (replay.own_ops);
- higher-order ops (``torch.cond``, ``flex_attention``): ``supports_higher_order_operators``
  hands one to the mode as one call, run in :func:`_run_hop` by its dense kernel
  (``HigherOrderOperator.dispatch``) with the mode pushed again by torch's own ``__enter__``;
  the mode's ``__enter__`` sets ``torch.compiler.set_stance("force_eager")``, since the eager
  flex_attention and cond compile themselves, which dynamo refuses under such a mode, and runs
  cond and while_loop by their Python definitions, put in place of their autograd kernels
  (``HigherOrderOperator.py_kernels``, ``_dispatch_cache``) while it is on (:func:`eager_torch`);
- ``FOREACH_MUL_``: ``aten._foreach_mul_.Scalar``, the foreach kernels' in-place product of
  many tensors with one number (a foreach optimizer's weight decay, :mod:`replay.weight_scale`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# (an inference-mode tensor, a teacher run under torch.inference_mode(), keeps no version: None;
# the torch.func transform a call runs under, None outside any)
from recorder.compat import func_transform, version_of

from .eager_control_flow import definitions
from .wrapper_subclass import passes_to_subclass

__all__ = ["TorchDispatchMode", "eager_torch", "tree_leaves", "tree_map", "version", "version_of", "sequence_nr",
           "func_transform",
           "running_node", "saved_value", "writes_arguments",
           "set_parameter", "set_buffer", "OP_ERROR", "remove_member", "FOREACH_MUL_", "custom_op_kernel",
           "written_places", "returns_values"]

FOREACH_MUL_ = torch.ops.aten._foreach_mul_.Scalar
_EFFICIENT_ZERO = torch.ops.aten._efficientzerotensor
# set on an exception an aten op raised inside one of the replay's dispatch modes
OP_ERROR = "nanreplay_op_error"
# what the dense kernel of cond, scan, while_loop, invoke_subgraph raises at entry under a mode
_REFUSES_MODE = "Mode should never be enabled"


class TorchDispatchMode(_TorchDispatchMode):
    """torch's dispatch mode, each subclass's ``__torch_dispatch__`` wrapped so that it never
    meets an efficient zero (see the module's docstring): the op making one returns real
    zeros unwatched (nothing non-finite to see), and one given to an op is made real first.
    A higher-order op's body is watched as the model's own aten ops (:func:`_run_hop`)."""

    # (without it a higher-order op raises 'no rule registered for HigherOrderOperator')
    supports_higher_order_operators = True

    def __enter__(self):
        # torch.compile'd code under the mode runs eagerly, its ops watched: dynamo skips
        # frames under a non-infra mode, and flex_attention's eager path compiles itself with
        # fullgraph=True, which then raises (and leaves dynamo refusing it for the process)
        eager = eager_torch()
        eager.__enter__()
        self.__dict__.setdefault("_nanreplay_stances", []).append(eager)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._nanreplay_stances.pop().__exit__(None, None, None)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__torch_dispatch__")
        if own is None:
            return

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, HigherOrderOperator):
                return _run_hop(self, func, args, kwargs or {})
            if passes_to_subclass(types):  # (its own dispatch's plain ops come back)
                return NotImplemented
            if func.overloadpacket is _EFFICIENT_ZERO:
                return tree_map(_real_zeros, func(*args, **(kwargs or {})))
            if _any_zeros(args, kwargs):
                args, kwargs = tree_map(_real_zeros, (args, kwargs))
            try:
                return own(self, func, types, args, kwargs)
            except NotImplementedError as e:
                if getattr(e, OP_ERROR, False):  # (the op's own: a subclass falls back on it)
                    raise
                # the mode's own failure: as NotImplementedError a tensor subclass's
                # __torch_function__ (a jagged nested tensor's) takes it for an op it lacks,
                # runs another path unwatched and the failure goes unseen
                raise RuntimeError(f"{type(self).__name__} failed on {func}: {e}") from e
        cls.__torch_dispatch__ = __torch_dispatch__


@contextlib.contextmanager
def eager_torch():
    """torch.compile's stance set to force_eager, and ``torch.cond``, ``torch.while_loop`` run
    by their Python definitions (:mod:`replay.eager_control_flow`): the model's every op runs
    eagerly, as its own aten op with its own autograd node. The definitions replace the
    operators' autograd kernels (``py_kernels``), which run first and would keep the user's
    callables for the backward; as kernels, not a TorchFunctionMode, no frame of the replay's
    sits between the model's code and its ops (a warning of torch's names the model's line)."""
    stance = _force_eager()
    kept = {op: op.py_kernels.get(DispatchKey.Autograd) for op in _DEFINED}
    try:
        for op, fn in _DEFINED.items():
            _set_autograd_kernel(op, _positional(fn, kept[op]))
        yield
    finally:
        for op, kernel in kept.items():
            _set_autograd_kernel(op, kernel)
        if stance is not None:
            stance.__exit__(None, None, None)


_DEFINED = definitions()


def _positional(fn, kernel):
    """``fn`` for the call forms it defines (positional), torch's ``kernel`` for the others."""
    def run(*args, **kwargs):
        if kwargs and kernel is not None:
            return kernel(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


def _set_autograd_kernel(op, kernel) -> None:
    if kernel is None:
        op.py_kernels.pop(DispatchKey.Autograd, None)
    else:
        op.py_kernels[DispatchKey.Autograd] = kernel
    op._dispatch_cache.clear()  # (the kernel each dispatch key resolved to)


def _force_eager():
    """torch.compile's stance set to force_eager, undone by the returned object's
    ``__exit__``; None inside a compiled region, where the stance cannot be set."""
    try:
        return torch.compiler.set_stance("force_eager")
    except RuntimeError:
        return None


def _run_hop(mode, hop: HigherOrderOperator, args, kwargs):
    """A higher-order op reaching ``mode`` (popped): its dense kernel with ``mode`` pushed
    again, so the ops of its body (flex_attention's scores, its score_mod) reach the mode as
    the model's own; a kernel refusing any mode at entry (cond's, before it runs anything)
    gets the op again with its callable arguments (the branches) run under the mode. torch's own ``__enter__`` pushes
    it, not the subclass's (Float64's would save float64 as the default dtype to restore)."""
    if DispatchKey.CompositeExplicitAutograd not in hop.py_kernels:
        return hop(*args, **kwargs)  # (no eager kernel to run: the op's values unwatched)
    try:
        with _pushed(mode):
            return hop.dispatch(DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
    except AssertionError as e:
        if _REFUSES_MODE not in str(e):
            raise
    args = tuple(_under(mode, a) if callable(a) and not isinstance(a, torch.Tensor) else a
                 for a in args)
    return hop(*args, **kwargs)  # (through the modes below this one, each wrapping them too)


class _pushed:
    """``mode`` on the dispatch stack again, by torch's ``TorchDispatchMode.__enter__``."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        _TorchDispatchMode.__enter__(self.mode)

    def __exit__(self, *exc):
        _TorchDispatchMode.__exit__(self.mode, *exc)


def _under(mode, fn):
    def run(*args, **kwargs):
        with _pushed(mode):
            return fn(*args, **kwargs)
    return run


def _any_zeros(args, kwargs) -> bool:
    """An efficient zero among an op's arguments or in a list of them (``cat``'s): checked on
    every op of every replay watcher, so without ``tree_leaves`` (1 µs an op, not 6)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if a._is_zerotensor():
                return True
        elif isinstance(a, (list, tuple)) and any(
                isinstance(b, torch.Tensor) and b._is_zerotensor() for b in a):
            return True
    return False


def _real_zeros(t):
    if isinstance(t, torch.Tensor) and holds_no_data(t):
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it grows with every in-place write to ``t``."""
    return t._version


_WRITES: dict[Any, bool] = {}


def running_node():
    """The autograd node whose backward is running the current op (an op of a backward the
    forward ran itself, through ``torch.autograd.grad``), None outside a backward."""
    return torch._C._current_autograd_node()


def holds_no_data(t: torch.Tensor) -> bool:
    """``t`` is autograd's efficient zero (``aten._efficientzerotensor``): all zeros by
    definition, with no storage a reduction can read (aminmax raises on it)."""
    return t._is_zerotensor()


def saved_value(node, name: str):
    """``node._saved_<name>``, or None when reading it would run an unpack hook: activation
    checkpointing (``use_reentrant=False``) re-runs its whole region to unpack one, which in
    the forward would run that region's modules and ops again inside the call being watched."""
    raw = getattr(node, f"_raw_saved_{name}", None)
    if raw is not None and getattr(raw, "unpack_hook", None) is not None:
        return None
    return getattr(node, f"_saved_{name}", None)


def sequence_nr(node) -> int:
    """An autograd node's creation number: nodes made later (in one thread) have larger ones."""
    return node._sequence_nr()


def takes_dtype(func) -> bool:
    """Whether the aten op ``func`` has a ``dtype`` argument (a factory: ``randn``, ``rand``)."""
    return any(a.name == "dtype" for a in func._schema.arguments)


def writes_arguments(func) -> bool:
    """Whether the aten op ``func`` is in-place or ``out=``: it writes into an argument."""
    hit = _WRITES.get(func)
    if hit is None:
        hit = _WRITES[func] = any(a.alias_info is not None and a.alias_info.is_write
                                  for a in func._schema.arguments)
    return hit


def returns_view(func) -> bool:
    """Whether the aten op ``func`` returns a view of an argument (``select``, a slice)."""
    return any(r.alias_info is not None for r in func._schema.returns)


def set_parameter(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """``module.<name> = value`` as a parameter entry, without ``__setattr__``'s checks (a
    plain tensor too: a cast of the parameter for one forward, see ``replay.precision``)."""
    module._parameters[name] = value


def parameter_like(p: torch.Tensor, data: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``data``, of ``p``'s class and with its Python attributes: geoopt's
    ``ManifoldParameter`` carries the manifold its Riemannian optimizer reads, and a plain
    ``nn.Parameter(data)`` would make the re-run update it as a Euclidean one."""
    cls = type(p)
    if cls is nn.Parameter or not issubclass(cls, nn.Parameter):
        return nn.Parameter(data, requires_grad=p.requires_grad)
    new = torch.Tensor._make_subclass(cls, data, p.requires_grad)
    new.__dict__.update(p.__dict__)
    return new


def grad_hooks(t: torch.Tensor) -> dict:
    """The hooks ``t.register_hook`` put on leaf tensor ``t`` (a parameter), by handle id; the
    engine calls this dict's values, so replacing one replaces that hook ({} when none)."""
    return t._backward_hooks if t._backward_hooks is not None else {}


def set_buffer(module: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """``module.<name> = value`` as a buffer entry (its persistence kept as it is)."""
    module._buffers[name] = value


def in_buffers(t: torch.Tensor, ids: set[int]) -> bool:
    """``t`` or the tensor it is a view of (``t._base``: a mask buffer sliced to the sequence)
    is in ``ids``."""
    return id(t) in ids or (t._base is not None and id(t._base) in ids)


def non_persistent(model: nn.Module, name: str) -> bool:
    """Buffer ``name`` (dotted) of ``model`` is registered with ``persistent=False``."""
    mod_name, _, attr = name.rpartition(".")
    return attr in model.get_submodule(mod_name)._non_persistent_buffers_set


def remove_member(module: nn.Module, name: str) -> None:
    """Remove ``name`` from the module's parameters, buffers, submodules and plain attributes."""
    for table in (module._parameters, module._buffers, module._modules):
        table.pop(name, None)
    module.__dict__.pop(name, None)


def no_process_group(e: BaseException) -> bool:
    """Whether ``e`` is torch.distributed's error for a call that needs the default process
    group where none was initialised (its message, as torch 2.x words it)."""
    return isinstance(e, (ValueError, RuntimeError)) and \
        "process group has not been initialized" in str(e)


def custom_op_kernel(func, device: str):
    """The Python kernel ``torch.library.custom_op`` registered for aten-level op ``func`` on
    ``device`` (or for every device), else its own function; None for any other op."""
    try:
        from torch._library.custom_ops import OPDEFS
        opdef = OPDEFS.get(func._schema.name)
    except (ImportError, AttributeError):
        return None
    if opdef is None:
        return None
    fns = getattr(opdef, "_backend_fns", {})
    return fns.get(device) or fns.get(None) or getattr(opdef, "_init_fn", None)


def written_places(func) -> list[tuple[int, str]]:
    """(position, name) of each argument op ``func`` writes, by its schema."""
    return [(i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def returns_values(func) -> bool:
    """Whether op ``func`` returns anything (a custom op writing into ``out`` returns none)."""
    return bool(func._schema.returns)


def fx_node_at(gm: nn.Module, line: int):
    """The node of torch.fx ``GraphModule`` ``gm`` whose generated code is line ``line`` of
    its ``forward`` (its private line map, offset by the code's prologue), else None."""
    lines, start = getattr(gm, "_lineno_map", None), getattr(gm, "_prologue_start", 0)
    index = lines.get(line - start) if isinstance(lines, dict) else None
    nodes = list(gm.graph.nodes) if index is not None else []
    return nodes[index] if 0 <= (index or 0) < len(nodes) else None


@contextlib.contextmanager
def frame_tracebacks():
    """Anomaly mode's forward traceback of each autograd node as ``File "f", line N, in fn``
    lines, without each frame's source line: torch's (``torch.fx.traceback.format_stack``, which
    anomaly mode calls for every op) reads every line and, on Python 3.11, parses each for its
    caret anchors: 1.6 ms an op under a deep stack, a tenth of a replay's time. What the replay
    reads of a traceback is its files, lines and functions (:mod:`replay.source`)."""
    real = fx_traceback.format_stack

    def frames_only() -> list[str]:
        if fx_traceback.has_preserved_node_meta():  # (an FX trace's own, as torch gives it)
            return real()
        out, frame = [], sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            out.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
            frame = frame.f_back
        out.reverse()
        return out

    fx_traceback.format_stack = frames_only
    try:
        yield
    finally:
        fx_traceback.format_stack = real
