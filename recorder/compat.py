"""Every private PyTorch API and attribute the recorder uses, in one place, so a torch upgrade
touches this file only.

Each name here wraps one private detail: version counters and view bases (how the recorder
knows an output is unchanged), foreach kernels (one call for many small tensors), BatchNorm's
base class (statistics that change without moving the version counter), GradScaler's scale, growth
tracker and per-step state, torch.func's transform stack, compile wrappers (dynamo's
``OptimizedModule`` and in-place compilation), dynamo's switch that traces backward, dynamo's
mark for a function it must run and not trace, and
the autocast regions a decorated ``forward`` enters, torch.distributions' default
``validate_args``, an ``nn.Module``'s own slots (what its ``named_*`` methods leave out: ``None`` entries and the
non-persistent buffer names), whether a backward is running (checkpointing's recomputation),
where a DTensor's local shard sits (the checkpoint protocol), whether a torch.func
``functional_call`` is running (its parameters the call's own), whether a caller of a given
name is on the stack, the base class of pipeline stages, and
a process group's key-value store (where the ranks meet at attach).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

# torch._dynamo is not imported here: it costs ~2 s, paid by every ``import recorder`` and
# every ``nanreplay --info``. An ``OptimizedModule`` exists only once torch.compile (or the
# user) imported its module, so the checks look it up there; the hooks' wrapper imports it at
# attach (see dynamo_disabled).
_EVAL_FRAME = "torch._dynamo.eval_frame"

# the attribute of an OptimizedModule holding the module it compiled (and the name part it
# adds to parameter names)
WRAPPER = "_orig_mod"

# the torch.func transform (vmap, grad, jacrev...) a call runs under, None outside any: a
# function called directly, so each hook pays one C call (~60 ns)
try:
    func_transform = torch._C._functorch.peek_interpreter_stack
except AttributeError:  # a torch without functorch
    def func_transform() -> None:
        return None

try:  # dynamo's compiled code kept per code object (see forget_compiled_code)
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list as _cache_entries
    from torch._C._dynamo.eval_frame import reset_code as _reset_code
except ImportError:
    _cache_entries = _reset_code = None

try:
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # a torch without dynamo
    _set_eval_frame = None


def _dynamo_attr(name: str) -> Any:
    """``torch._dynamo.eval_frame.<name>`` if that module is loaded, else None (then no
    compile wrapper exists yet)."""
    return getattr(sys.modules.get(_EVAL_FRAME), name, None)


def dynamo_disabled(fn):
    """``fn`` run eagerly when dynamo meets it, as ``torch.compiler.disable(fn)`` does: dynamo
    does not inline a function marked ``_torchdynamo_disable`` (it breaks the graph and calls
    it), does not compile the wrapper's frame when a compiled caller calls it (its code is
    skipped, as dynamo's own files are), and compiles nothing it runs (no eval-frame callback
    inside). Without ``disable``'s per-call stance and export checks, which a hook paid five
    times a step, cold (~10 us each)."""
    if _set_eval_frame is None:
        return fn
    try:  # (called at attach, not per step: a model compiled later must not trace the hook)
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without dynamo
        return fn
    set_eval_frame = _set_eval_frame

    def run(*args, **kwargs):
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    skip_code(run.__code__)  # (one code object for every wrapper; marking it again is a no-op)
    run._torchdynamo_disable = True  # what dynamo reads (and guards on: the original callable)
    # (dynamo's error under fullgraph=True quotes it: say why the graph breaks and what to do)
    run._torchdynamo_disable_msg = (
        "nanreplay's hook, which runs outside dynamo's graphs: a function compiled with "
        "fullgraph=True cannot call the recorded model (its hooks split the graph there); "
        "compile the model itself with fullgraph=True (torch.compile(model, fullgraph=True)) "
        "and the function calling it without")
    run._torchdynamo_orig_callable = fn
    run._torchdynamo_wrapper_id = id(run)
    run._torchdynamo_disable_recursive = True
    return run


# ---------------------------------------------------------------------------------------------
# tensors


def distributions_validate_default() -> bool:
    """torch.distributions' process-wide default for ``validate_args``, which
    ``Distribution.set_default_validate_args`` sets (no public getter)."""
    return bool(getattr(torch.distributions.Distribution, "_validate_args", True))


def grad_hooks(t: torch.Tensor) -> list:
    """The hooks ``t.register_hook`` put on ``t`` (its ``_backward_hooks``), in order."""
    hooks = getattr(t, "_backward_hooks", None)
    return list(hooks.values()) if hooks else []


def accumulate_hooks(t: torch.Tensor) -> list:
    """The hooks ``t.register_post_accumulate_grad_hook`` put on ``t``, in order."""
    hooks = getattr(t, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def forward_hooks(m: nn.Module) -> list[tuple[str, Any]]:
    """``(kind, hook)`` of the forward pre-hooks, forward hooks, backward pre-hooks and (full)
    backward hooks registered on ``m`` (its ``_forward_pre_hooks``, ``_forward_hooks``,
    ``_backward_pre_hooks``, ``_backward_hooks``), in order."""
    return [(kind, h) for kind, d in (
        ("forward_pre", m._forward_pre_hooks), ("forward", m._forward_hooks),
        ("backward_pre", m._backward_pre_hooks), ("backward", m._backward_hooks))
        for h in d.values()]


def global_forward_hooks() -> bool:
    """Some forward hook is registered for every module (``register_module_forward_hook``)."""
    return bool(torch.nn.modules.module._global_forward_hooks)


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference-mode tensor, which keeps no version counter (so
    whether it changed in place is unknown: it is measured again, its buffer copied again)."""
    try:  # (no ``is_inference()`` call first: this runs for every output of every step)
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def version(t: torch.Tensor) -> int:
    """``t._version`` of a tensor known to keep one (a gradient, an output of this step). (A
    function, not ``operator.attrgetter``: dynamo traces hooks that run inside a compiled
    region, and it cannot trace an attrgetter.)"""
    return t._version


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The specified values of a sparse tensor (COO: uncoalesced, no copy)."""
    return t._values() if t.layout == torch.sparse_coo else t.values()


def sparse_indices(t: torch.Tensor) -> torch.Tensor:
    """The indices of a sparse COO tensor's specified values (uncoalesced, no copy)."""
    return t._indices()


def sparse_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dim-0 index, value) of each specified element of a sparse COO tensor, coalesced."""
    t = t.coalesce()
    return t._indices()[0], t._values()


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``t._base``), None when it is no view."""
    return t._base


def in_backward() -> bool:
    """A backward is running the current code (activation checkpointing's recomputation of a
    forward inside it): ``torch._C._current_autograd_node``."""
    return torch._C._current_autograd_node() is not None


def backward_task() -> int:
    """The running backward's id (``torch._C._current_graph_task_id``), -1 outside one."""
    return torch._C._current_graph_task_id()


def writes_grads(p: torch.Tensor) -> bool:
    """The running backward accumulates into ``.grad`` (``backward()``), not only hands the
    gradients back (``torch.autograd.grad``), asked with the leaf ``p`` it reaches. torch has
    no public question for this; ``_will_engine_execute_node`` refuses a leaf under
    ``autograd.grad`` alone. Unsure: True (the ``.grad`` hooks then do the work)."""
    try:
        torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)
    except RuntimeError as e:
        return "autograd.grad" not in str(e)
    except Exception:
        return True
    return True


def at_backward_end(fn: Any) -> None:
    """Run ``fn`` when the running backward has finished (DDP's and FSDP's final callback:
    ``Variable._execution_engine.queue_callback``); an error it raises comes out of the
    ``backward()`` call as raised. Only from inside a backward."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# autocast is on for some device type: one C call (instead of one per device type)
any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))


def forward_autocasts(fn: Any) -> list[tuple[str, torch.dtype, bool]]:
    """``(device type, dtype, enabled)`` of each ``torch.autocast`` region the function ``fn``
    enters itself, outermost first: ``@torch.autocast(...)`` on a ``forward``, or accelerate's
    mixed precision, which wraps the model's ``forward`` so. Read from the closures along its
    ``__wrapped__`` chain (``functools.wraps``); nothing is called."""
    out = []
    for _ in range(32):
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:  # (a cell not filled yet)
                continue
            if isinstance(v, torch.autocast):
                out.append((str(v.device), v.fast_dtype, bool(v._enabled)))
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return out


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """2-norms of ``tensors`` in one kernel launch per dtype/device group."""
    return torch._foreach_norm(tensors, 2, dtype=dtype)


def foreach_square_(tensors: list[torch.Tensor]) -> None:
    torch._foreach_mul_(tensors, tensors)


# ---------------------------------------------------------------------------------------------
# modules


def is_norm_layer(m: nn.Module) -> bool:
    """BatchNorm/InstanceNorm-style layers, which update running statistics inside the kernel
    without moving their buffers' version counters."""
    return isinstance(m, _NormBase)


def own_slots(m: nn.Module) -> tuple[set[str], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(non-persistent buffer names, buffers, parameters, children) registered on ``m`` itself,
    ``None`` entries included (``named_buffers`` and friends leave those out)."""
    return m._non_persistent_buffers_set, m._buffers, m._parameters, m._modules


def is_compile_wrapper(m: Any) -> bool:
    wrapper = _dynamo_attr("OptimizedModule")
    return wrapper is not None and isinstance(m, wrapper)


def compiles(wrapper: nn.Module) -> bool:
    """Compile wrapper ``wrapper`` compiles what it wraps: not ``torch.compiler.disable(m)``,
    which wraps ``m`` in the same ``OptimizedModule`` to run it eagerly, hooks and all."""
    return not isinstance(getattr(wrapper, "dynamo_ctx", None),
                          _dynamo_attr("DisableContext") or ())


def compiled_module(wrapper: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper compiled."""
    return wrapper._orig_mod


def uncompiled(m: nn.Module) -> nn.Module:
    """``m`` without its ``torch.compile`` wrappers (``OptimizedModule``s, nested or not)."""
    while is_compile_wrapper(m):
        m = compiled_module(m)
    return m


def compiled_in_place(m: nn.Module) -> bool:
    """``m.compile()``, or ``m.forward = torch.compile(m.forward)`` (what Lightning does to a
    compiled LightningModule, with its ``training_step``)."""
    return getattr(m, "_compiled_call_impl", None) is not None or \
        hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable")


def compiled_function(fn: Any) -> bool:
    """``fn`` is what ``torch.compile(fn)`` returned for a function."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def compiled_original(fn: Any) -> Any:
    """The function ``torch.compile`` compiled into ``fn``; ``fn`` itself if it is none."""
    while compiled_function(fn):
        fn = fn._torchdynamo_orig_callable
    return fn


def undo_in_place_compile(m: nn.Module) -> None:
    """Make ``m`` run eagerly again after :func:`compiled_in_place` compilation."""
    m._compiled_call_impl = None
    forward = m.__dict__.get("forward")
    if hasattr(forward, "_torchdynamo_orig_callable"):
        m.forward = forward._torchdynamo_orig_callable


# ---------------------------------------------------------------------------------------------
# GradScaler


def is_grad_scaler(obj: Any) -> bool:
    # (a disabled GradScaler(enabled=False) sets none of its state: its class tells)
    return hasattr(obj, "_per_optimizer_states") or isinstance(obj, torch.amp.GradScaler)


def disabled_scaler(obj: Any) -> bool:
    """A ``GradScaler(enabled=False)``: ``scale()`` returns the loss, ``step()`` calls
    ``optimizer.step()``, ``update()`` does nothing, as without a scaler."""
    return is_grad_scaler(obj) and callable(getattr(obj, "is_enabled", None)) \
        and not obj.is_enabled()


def scaler_scale(scaler) -> torch.Tensor | None:
    """The scale tensor (None before the first ``scale()``, or without a scaler)."""
    return getattr(scaler, "_scale", None)


def scaler_unscaled(scaler, optimizer) -> bool:
    """The GradScaler unscaled ``optimizer``'s gradients this step (``unscale_``, or inside
    ``scaler.step``: its ``OptState``), so they hold what the update takes; False while they
    are still scaled (a loop calling ``opt.step()`` past the scaler)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    return getattr(state and state.get("stage"), "name", None) in ("UNSCALED", "STEPPED")


def scaler_token(scaler) -> int | None:
    """Changes exactly when a step ends for the scaler: ``update()`` replaces this dict."""
    return id(getattr(scaler, "_per_optimizer_states", None)) if scaler is not None else None


def scaler_tensors(scaler) -> dict[str, torch.Tensor]:
    """The scale and growth tracker as the tensors they are (``scale``, ``growth_tracker``;
    absent before the first ``scale()``): ``state_dict()`` reads them with ``.item()``, a
    sync, which the rewind window's copies must not make."""
    found = {"scale": getattr(scaler, "_scale", None),
             "growth_tracker": getattr(scaler, "_growth_tracker", None)}
    return {k: t for k, t in found.items() if isinstance(t, torch.Tensor)}


# ---------------------------------------------------------------------------------------------
# DTensor (FSDP2)


def dtensor_chunk(t) -> tuple[list[int], list[int]]:
    """(offset, shape) of DTensor ``t``'s local shard in the full tensor: the chunk list that
    ``torch.distributed.checkpoint`` reads through ``DTensor.__create_chunk_list__`` (a
    protocol method, not public API)."""
    chunk = t.__create_chunk_list__()[0]
    return list(chunk.offsets), list(chunk.sizes)


def process_group_store(group=None):
    """The key-value store of ``group`` (None: the default group's, from
    ``init_process_group``): keys the ranks set and wait for with a timeout of their own,
    without a device collective."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store() if group is None else c10d._get_process_group_store(group)


def fsdp_mp_policy(module):
    """The ``MixedPrecisionPolicy`` that ``fully_shard(module, mp_policy=...)`` was given
    (FSDP2's private state: no public getter), or None."""
    get_state = getattr(module, "_get_fsdp_state", None)
    return getattr(get_state(), "_mp_policy", None) if get_state is not None else None


def frame_compiled(fn: Any) -> bool:
    """Dynamo holds code it compiled for ``fn``'s own frame (``fn`` was compiled as the
    function ``torch.compile`` was given, not inlined into a caller's graph)."""
    code = getattr(fn, "__code__", None)
    return code is not None and _cache_entries is not None and bool(_cache_entries(code))


def traces_backward() -> bool:
    """Dynamo traces ``Tensor.backward()`` into compiled code
    (``torch._dynamo.config.trace_autograd_ops``); False while dynamo is not loaded."""
    config = sys.modules.get("torch._dynamo.config")
    return bool(getattr(config, "trace_autograd_ops", False))


def forget_every_compiled_code() -> bool | None:
    """Drop the code dynamo compiled for every frame it compiled in this process (the code
    objects its ``convert_frame`` trackers hold, as ``torch._dynamo.reset_code_caches`` does,
    without its other state), so that each compiles again at its next call. Whether any was
    dropped; None where this torch keeps no such trackers."""
    frames = sys.modules.get("torch._dynamo.convert_frame")
    if frames is None:  # (nothing was compiled)
        return False
    trackers = [getattr(frames, name, None) for name in ("input_codes", "output_codes")]
    if _cache_entries is None or _reset_code is None \
            or not all(isinstance(getattr(t, "seen", None), list) for t in trackers):
        return None
    dropped = False
    with getattr(frames, "compile_lock", contextlib.nullcontext()):
        for ref in [r for t in trackers for r in t.seen]:
            code = ref()
            if code is not None and _cache_entries(code):
                _reset_code(code)
                dropped = True
    return dropped


def forget_compiled_code(wrapper: nn.Module) -> bool:
    """Drop the code dynamo compiled for the frames compile wrapper ``wrapper`` runs (its
    ``forward``'s ``__wrapped__`` chain), so that its next call compiles again. Dynamo does not
    guard on module hooks (``skip_nnmodule_hook_guards``), and that code, shared by every
    ``torch.compile(module)`` wrapper, ran the module without the hooks it had not yet: hooks
    added after a compiled call (the recorder attached after a warm-up forward, or around a
    second model of the same class) never ran. Whether any was dropped."""
    if _cache_entries is None or _reset_code is None:
        return False
    dropped, fn, seen = False, wrapper.__dict__.get("forward"), 0
    while fn is not None and seen < 8:  # (a chain of a few wrappers; never a cycle)
        code, seen = getattr(fn, "__code__", None), seen + 1
        if code is not None and _cache_entries(code):
            _reset_code(code)
            dropped = True
        fn = getattr(fn, "__wrapped__", None)
    return dropped


def ddp_comm_hooks(ddp: nn.Module) -> list[tuple[Any, Any]]:
    """``[(hook, state), ...]`` registered with ``ddp.register_comm_hook`` (DDP keeps them
    privately), else ``[(name, None)]`` for a built-in C++ hook, known by its name in DDP's
    logging data only."""
    hooks = list(getattr(ddp, "_comm_hooks", None) or ())
    if hooks:
        return hooks
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        name = None
    return [(str(name), None)] if name else []


def in_functional_call() -> bool:
    """Whether this runs inside ``torch.func.functional_call`` (or the deprecated
    ``torch.nn.utils.stateless.functional_call``), whose private ``_functional_call`` holds the
    module's parameter names bound to the call's own tensors while the module runs (a mean
    teacher's EMA copy, MAML's adapted ``p - lr * g``), put back as it returns. Slow path."""
    tail = ("torch", "nn", "utils", "stateless.py")
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_functional_call" \
                and tuple(code.co_filename.replace("\\", "/").split("/")[-4:]) == tail:
            return True
        frame = frame.f_back
    return False


def called_within(names: frozenset[str], depth: int) -> bool:
    """Whether a function of one of ``names`` is among the caller's ``depth`` callers."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def pipeline_stage_class() -> type | None:
    """The base class of ``torch.distributed.pipelining``'s stages (``PipelineStage`` and the
    ``pipeline()`` split's), or None."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return None
    return _PipelineStageBase


def join_entered(ddp: nn.Module) -> bool:
    """Whether a ``torch.distributed.algorithms.join.Join`` was built over ``ddp`` (its join
    config is enabled from then on)."""
    config = getattr(ddp, "_join_config", None)
    return bool(config is not None and config.enable)


def join_parts(join: Any) -> tuple[list, list]:
    """A ``Join``'s joinables and the hooks it built from them, index for index."""
    return join._joinables, join._join_hooks
