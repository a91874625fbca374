"""``FlightRecorder``: module hooks, the step lifecycle, and the one host sync per step.

A step opens at the first root-module forward after the previous step closed, capturing the RNG
states and the pre-step value of buffers that change. Each module call adds 0-d statistics to the
step's :class:`~recorder.tape.Tape` on the device. The step closes at ``optimizer.step()`` (its
pre-hook, so a bad step never updates the weights), or, for loops without an optimizer or steps
that a ``GradScaler`` skipped, when the next step opens. Closing stacks the statistics into one
row of the ring buffer and reads one small probe back (finiteness of what must be finite, the
NaN check of the rest, the GradScaler's scale; the last update's weight norms ride in the row):
that read is the only host-device sync. Only when the probe says "non-finite" does the slow
path run, which finds the first offender and writes the bundle.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import threading
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from . import events
from .capture import RngCapture, distributed_rank, git_commit, tensor_leaves
from .compiled import disabled, eager_name, hook_sites, unwrap
from .errors import NonFiniteError
from .hooks import Hook
from .ring import RingBuffer, StepLayout
from .slots import GRAD, LOOSE, NAN_ONLY, STRICT, Slots
from .snapshot import build_bundle
from .tape import MicroBatch, Tape
from .validate import validate, validate_settings

log = logging.getLogger("nanreplay")

_SMALL = 1 << 15  # parameters with fewer elements get batched norms (see attach)...
_FEW = 16  # ...when there are more than this many of them
_CPU = torch.device("cpu")


class _CallableLoss(nn.Module):
    """Gives a plain loss function the hooks a loss module has (call it as ``recorder.loss_fn``)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class FlightRecorder:
    """Records per-layer statistics every step and writes a bundle at the first NaN/Inf.

    >>> with FlightRecorder(model, optimizer, loss_fn=criterion,    # doctest: +SKIP
    ...                     out_dir="nan-bundles", factory="mypkg.train:make_model"):
    ...     for x, y in loader:
    ...         optimizer.zero_grad()
    ...         loss = criterion(model(x), y)
    ...         loss.backward()
    ...         optimizer.step()   # raises NonFiniteError(bundle_path=...) on the first event

    Args:
        model: the root module; its forward is one micro-batch of a step.
        optimizer: optional; ``optimizer.step()`` closes a step. Without one, a step is one
            root forward (closed when the next begins, at :meth:`end_step` or at detach).
        loss_fn: optional loss module or callable. A module is hooked in place; a plain
            function must be called through :attr:`loss_fn` to be seen.
        out_dir: where bundles go (created if missing).
        factory: ``"module:function"`` that rebuilds the model, for ``nanreplay``.
        factory_kwargs: keyword arguments (JSON values) the replay passes to ``factory``: the
            run-time configuration (command-line flags, config files) the model was built
            with, which the factory cannot see on its own. Stored in the bundle.
        history: steps kept in the ring buffer.
        on_event: ``"raise"`` (write the bundle, raise :class:`NonFiniteError`) or ``"warn"``
            (write it once, log, keep training).
        strict_inf: what a +-Inf is. False (default): a NaN anywhere is an event, a +-Inf only
            where it matters: in the root module's output, the loss, a gradient, a weight or
            optimizer state, or when it turns into a NaN; one that stays inside the model (an
            additive ``-inf`` mask passed to ``forward``, masked attention scores) is recorded
            in the ring buffer but is no event. True: every +-Inf is an event, in every module
            output and root input, except where ``allow_inf`` says.
        allow_inf: name patterns (fnmatch) of modules whose outputs, buffers whose values and
            root inputs (a keyword argument's name, or ``args[i]``) that may hold +-Inf on
            purpose (masks). NaN is always an event. Mostly for ``strict_inf=True``; by default
            the patterns also exempt the root module's output (pattern ``""``) and tell the
            event finder which infinities are intentional.
        scaler: the ``torch.amp.GradScaler`` in use: steps it skips are not events, but a scale
            below ``min_scale`` or more than ``max_skipped_steps`` skips in a row are.
        lr_scheduler: saved in the bundle when given.
        guard_optimizer: keep a device copy of the weights, gradients and optimizer state
            before each ``optimizer.step()`` and check the weights right after it (a second
            sync), so a bundle can re-run an update that made weights non-finite. Off by
            default; without it such an event is caught at the next step and the bundle holds
            the state after the update.
        stats: ``"minmax"`` (default) records min, max, absmax and NaN/+-Inf flags of every
            call's output (one reduction per call) and every gradient's norm; ``"full"`` adds
            each output's mean and RMS and every parameter's norm (the total parameter norm
            per step), which costs another pass over the weights.
        start_step: the index of the first recorded step (when attaching mid-run).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 loss_fn=None, out_dir: str | os.PathLike = "nan-bundles",
                 factory: str | None = None, history: int = 64, on_event: str = "raise",
                 allow_inf: list[str] | tuple[str, ...] = (), scaler=None, lr_scheduler=None,
                 min_scale: float = 1.0, max_skipped_steps: int = 50,
                 guard_optimizer: bool = False, stats: str = "minmax", start_step: int = 0,
                 max_micro_batches: int = 1024, factory_kwargs: dict[str, Any] | None = None,
                 strict_inf: bool = False):
        validate(model, optimizer, loss_fn, out_dir, factory, history, on_event, allow_inf,
                  scaler)
        validate_settings(stats=stats, min_scale=min_scale, start_step=start_step,
                          max_skipped_steps=max_skipped_steps,
                          max_micro_batches=max_micro_batches, lr_scheduler=lr_scheduler,
                          factory_kwargs=factory_kwargs, strict_inf=strict_inf)
        self.strict_inf = strict_inf
        self.out_dir = Path(out_dir)
        self.factory = factory
        self.factory_kwargs = dict(factory_kwargs) if factory_kwargs is not None else None
        # the training framework a callback records for ("huggingface", "lightning"): the
        # replay's advice names its options
        self.integration: str | None = None
        self._unrooted_advice = ("Give FlightRecorder the module whose forward your training "
                                 "step calls (or call the model itself)")
        self.history = history
        self.on_event = on_event
        self.allow_inf = tuple(allow_inf)
        self.min_scale = float(min_scale)
        self.max_skipped_steps = int(max_skipped_steps)
        self.guard_optimizer = bool(guard_optimizer)
        self.stats = stats
        # A pass over every weight each step costs as much memory traffic as the gradient
        # norms; by default weights are read only when an event needs them (slow path).
        self._param_norms = stats == "full"
        self.max_micro_batches = int(max_micro_batches)
        self.bundle_path: Path | None = None
        self.event: dict[str, Any] | None = None

        # DistributedDataParallel / DataParallel / torch.compile: record the wrapped module, so
        # names and the factory are the user's model; DDP all-reduces gradients after backward
        # wrote them, so their norms are re-read before the update (see _optimizer_pre_hook).
        model, wrapper, self._ddp = unwrap(model)
        self._model = weakref.ref(model)
        self._wrapper = weakref.ref(wrapper) if wrapper is not None else None
        self._compiled_elsewhere = False  # set by a Trainer callback whose Trainer compiles
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._scaler = weakref.ref(scaler) if scaler is not None else None
        self._scheduler = weakref.ref(lr_scheduler) if lr_scheduler is not None else None
        if loss_fn is None or isinstance(loss_fn, nn.Module):
            self.loss_fn = loss_fn
        else:
            self.loss_fn = _CallableLoss(loss_fn)

        self._step = int(start_step)
        self._tape: Tape | None = None
        self._ring = RingBuffer(history)
        self._handles: list = []
        self._attached = False
        self._active = False
        self._fired = False
        self._lock = threading.RLock()
        self._updated = False  # an optimizer step ran since the last step opened
        self._skips = 0
        self._buffer_copies: dict[str, torch.Tensor] = {}
        self._buffer_versions: dict[str, int] = {}
        self._guard: dict[str, Any] | None = None
        self._last_tape: Tape | None = None
        self._buffers: list = []
        self._compiled: set[str] = set()  # names of compiled regions (recorded as one call)
        self._small: list[int] = []
        self._volatile_copies = None
        self._steady_buffers: list = []
        self._large: list = []
        self._slots: Slots | None = None
        self._grad_hooks = True
        self._volatile_buffers: set[str] = set()
        self._commit = git_commit()
        self._capture_rng = RngCapture()
        self._internal_errors = 0
        self._unrooted_call: int | None = None  # a submodule that ran while no step was open
        self._unrooted_warned = False
        self._eval_tail: Tape | None = None  # the last evaluation forward, until its loss runs
        self._loss_recorded = False  # record_loss has been given a loss (no loss_fn to replay)
        # evidence right after each update: squared norms of the weights it wrote, taken in the
        # optimizer's post-hook on the device and read with the next step's one host read
        self._update_slots: Slots | None = None
        self._probe: torch.Tensor | None = None  # [strict check, NaN-only min, max, scale]
        self._probe_views: tuple = ()
        self._probe_nan_only = False  # its min/max hold this step's NaN-only entries
        self._update_large: list[tuple[int, torch.Tensor]] = []
        self._update_small: list[tuple[int, torch.Tensor]] = []
        self._pending_update: tuple[int, list] | None = None  # (step of the update, refs)

    # ------------------------------------------------------------------------------------------
    # public surface

    def __enter__(self) -> FlightRecorder:
        self.attach()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._close_open_step(at="detach")
                self._check_last_update()
            else:
                self._check_on_exception(exc)
        finally:
            self.detach()

    def attach(self) -> FlightRecorder:
        """Register every hook. Idempotent."""
        if self._attached:
            return self
        model = self._model()
        if model is None:
            raise RuntimeError("FlightRecorder.attach: the model no longer exists")
        sites = hook_sites(model, self._wrapper() if self._wrapper is not None else None,
                           self._compiled_elsewhere)
        named = [(s.name, s.module) for s in sites]
        self._module_names = [n for n, _ in named]
        self._module_types = [type(m).__module__ + "." + type(m).__qualname__ for _, m in named]
        self._compiled = {s.name for s in sites if s.region}
        self._params = [(eager_name(n), p) for n, p in model.named_parameters()]
        self._buffers = [(eager_name(n), b) for n, b in model.named_buffers()]
        # BatchNorm-style layers update their running statistics inside the kernel, which
        # does not move the version counter: copy those at every step start.
        self._volatile_buffers = {f"{n}.{b}" if n else b for n, m in named
                                  if isinstance(m, _NormBase)
                                  for b, _ in m.named_buffers(recurse=False)}
        self._allowed_buffers = {id(b): weakref.ref(b) for n, b in self._buffers
                                 if self._is_allowed(n)}
        volatile = [(n, b) for n, b in self._buffers
                    if n in self._volatile_buffers and b.numel()]
        self._volatile_buffers = {n for n, _ in volatile}
        for n, b in volatile:
            self._buffer_copies[n] = torch.empty_like(b)
        self._volatile_copies = ([b for _, b in volatile],
                                 [self._buffer_copies[n] for n, _ in volatile]) if volatile else None
        self._steady_buffers = [(n, b) for n, b in self._buffers
                                if n not in self._volatile_buffers]
        # Only the root needs a pre-hook (it opens steps); every call is recorded when it
        # returns, with its inputs' statistics looked up from the calls that produced them.
        # (A compiled region's hooks go where dynamo does not trace them, see recorder.compiled;
        # the modules inside one are not hooked.)
        root = sites[0]
        # (every hook is a Hook: a copy of the model, an EMA average, gets inert ones)
        pre = disabled(self._root_pre_hook) if root.disable else self._root_pre_hook
        self._handles.append(root.target.register_forward_pre_hook(Hook(pre), with_kwargs=True))
        for idx, site in enumerate(sites):
            if site.target is None:
                continue
            relu = type(site.module) is nn.ReLU and idx
            fn = self._relu_hook if relu else self._post_hook
            allowed = self._inf_allowed(idx, site.name)
            hook = (Hook(disabled(partial(fn, idx, allowed))) if site.disable
                    else Hook(fn, idx, allowed))
            self._handles.append(site.target.register_forward_hook(hook, with_kwargs=True))
        if self.loss_fn is not None:
            self._handles.append(self.loss_fn.register_forward_hook(
                Hook(self._loss_post_hook), with_kwargs=True))
        opt = self._optimizer() if self._optimizer else None
        # Gradient norms are read once, right before the update, in a tight loop (cheaper than
        # a hook per parameter, and they are then what the optimizer uses: after DDP's
        # all-reduce, GradScaler's unscale, clipping). Backward hooks take them instead where
        # that moment may never come: no optimizer (the step closes at the next forward, after
        # the user's own update and zero_grad), or a GradScaler that may skip the update.
        self._grad_hooks = opt is None or self._scaler is not None
        # Many small parameters are batched into one foreach call per step.
        self._small = [i for i, (_, p) in enumerate(self._params)
                       if p.requires_grad and p.numel() < _SMALL]
        if len(self._small) <= _FEW:  # a foreach call only pays off for many
            self._small = []
        batched = set(self._small)
        self._large = [(i, p) for i, (_, p) in enumerate(self._params)
                       if p.requires_grad and i not in batched]
        if self._grad_hooks:
            for i, p in self._large:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    Hook(self._grad_hook, i)))
        if opt is not None:
            self._handles.append(opt.register_step_pre_hook(Hook(self._optimizer_pre_hook)))
            self._handles.append(opt.register_step_post_hook(Hook(self._optimizer_post_hook)))
            held = {id(p) for g in opt.param_groups for p in g["params"]}
            mine = [(i, p) for i, (_, p) in enumerate(self._params)
                    if id(p) in held and p.is_floating_point() and p.layout == torch.strided]
            small = [(i, p) for i, p in mine if p.numel() < _SMALL]
            if len(small) <= _FEW:  # (as for the gradient norms: foreach pays off for many)
                small = []
            self._update_small = small
            self._update_large = [(i, p) for i, p in mine if p.numel() >= _SMALL or not small]
        self._attached = self._active = True
        return self

    def detach(self) -> None:
        """Remove every hook and drop every reference to the model, optimizer and batches."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._tape = self._eval_tail = None
        self._guard = None
        self._buffer_copies.clear()
        self._buffer_versions.clear()
        self._last_tape = None
        self._buffers = []
        self._params = []
        self._large = []
        self._slots = self._update_slots = None
        self._update_large, self._update_small, self._pending_update = [], [], None
        self._allowed_buffers = {}
        self._attached = self._active = False

    def end_step(self) -> None:
        """Close the current step now (for loops without an optimizer that update by hand)."""
        self._close_open_step(at="end_step")

    def record_loss(self, loss) -> None:
        """Check a loss computed outside :attr:`loss_fn` (an inline ``F.cross_entropy`` in a
        Lightning ``training_step``; the Lightning callback calls this) with the open training
        step: a NaN/Inf in it is a ``loss`` event when the step closes, with no extra host
        read. Its inputs are not kept, so the replay re-runs the model but not the loss; a
        ``loss_fn`` it can call names the op. Ignored outside a training step."""
        tape = self._tape
        if not self._active or tape is None or not tape.micro_batches or tape.evaluation:
            return
        try:
            self._loss_recorded = True
            self._loss_stats(tape, loss)
        except Exception as e:
            self._internal_error(e)

    def _check_on_exception(self, exc: BaseException) -> None:
        """The loop raised ``exc`` while a step was open: the loop's own NaN guard (``if
        loss.isnan(): raise``), ``clip_grad_norm_(..., error_if_nonfinite=True)``, a crash
        mid-forward. Check what the step recorded so far (one host read) and, if it is
        non-finite, write the bundle; ``exc`` goes on, with the recorder's summary added as a
        note. The ``with`` block and the Lightning callback call this; a ``KeyboardInterrupt``
        is left alone."""
        if not isinstance(exc, Exception) or isinstance(exc, NonFiniteError):
            return
        tape = self._tape
        if not self._active or tape is None or self._fired:
            return
        try:
            if not tape.evaluation:  # gradients backward wrote, which no optimizer hook read
                self._reread_changed_grads(tape)
            self._close_tape(at="exception")
        except NonFiniteError as e:
            _add_note(exc, str(e))
            return
        except Exception as e:
            self._internal_error(e)
            return
        if self._fired and self.event is not None:  # warn mode: logged, and noted here too
            _add_note(exc, events.summary(self.event, self.bundle_path))

    @property
    def step(self) -> int:
        """Index of the step being recorded (or the next one, between steps)."""
        tape = self._tape
        if tape is not None and self._skipped_by_scaler(tape):
            return self._step + 1  # scaler.update() ended it; it is closed at the next forward
        return self._step

    @property
    def memory_bytes(self) -> dict[str, int]:
        """Device memory the recorder holds: ring buffer, the step's statistics slots, buffer
        copies, optimizer guard."""
        guard = 0
        if self._guard:
            guard = sum(t.numel() * t.element_size() for t in self._guard["tensors"])
        return {"ring": self._ring.nbytes,
                "statistics": self._slots.nbytes if self._slots is not None else 0,
                "buffer_copies": sum(t.numel() * t.element_size()
                                     for t in self._buffer_copies.values()),
                "optimizer_guard": guard}

    # ------------------------------------------------------------------------------------------
    # hooks: each one is a no-op after an internal error rather than a crash of training

    def _root_pre_hook(self, module, args, kwargs):
        if not self._active:
            return None
        try:
            root = self._model()  # (``module`` may be a compile wrapper, whose mode can lag)
            self._begin_micro_batch(args, kwargs, (module if root is None else root).training)
        except NonFiniteError:
            raise
        except Exception as e:  # never let the recorder's own bug stop training
            self._internal_error(e)
        return None

    def _post_hook(self, idx: int, allowed: bool, module, args, kwargs, output):
        tape = self._tape
        if tape is None or not self._active:
            return self._outside_step(idx, tape)
        try:
            mb = len(tape.micro_batches) - 1
            if idx == 0:
                ins = tape.micro_batches[mb].input_refs
            elif len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor and \
                    (hit := self._produced(tape, args[0], output)) is not None:
                ins = (hit[1:4],)  # one tensor in, an earlier call's output: the usual chain
            else:
                ins = self._input_refs(tape, args, kwargs, made_here=output)
            if type(output) is torch.Tensor and not self._param_norms:  # the usual case
                outs, stats = self._output_ref(tape, output, allowed, reuse=True), None
            else:
                outs, stats = self._output_refs(tape, output, allowed)
            tape.calls.append((idx, mb, len(tape.calls), outs, stats, ins))
            if idx == 0:
                self._end_micro_batch(tape, output)
        except Exception as e:
            self._internal_error(e)
        if idx == 0 and tape.evaluation and self._active:  # checked now, its batch let go
            self._close_tape(at="evaluation")
            if self.loss_fn is not None:  # ...once its loss is checked too (or none comes)
                self._eval_tail = tape
        return None

    def _outside_step(self, idx: int, tape: Tape | None) -> None:
        """A module hook with nothing to record: inactive, or no step open. A submodule called
        while no step is open is remembered for :meth:`_unrooted`."""
        if tape is None and idx and self._unrooted_call is None:
            self._unrooted_call = idx

    def _relu_hook(self, idx: int, allowed: bool, module, args, kwargs, output):
        """An ``nn.ReLU`` call: its output's min and max are the ReLU of its input's (ReLU is
        elementwise and non-decreasing; NaN stays NaN, -Inf becomes 0, +Inf stays), so they are
        derived from the input's statistics with one op on two numbers instead of a pass over
        the output. The input's come from the call that produced it, else from one
        ``aminmax``."""
        tape = self._tape
        if tape is None or not self._active:
            return self._outside_step(idx, tape)
        if len(args) != 1 or kwargs or type(args[0]) is not torch.Tensor \
                or type(output) is not torch.Tensor or output.dtype is not torch.float32 \
                or args[0].dtype is not torch.float32 or self._param_norms:
            return self._post_hook(idx, allowed, module, args, kwargs, output)
        try:
            a, slots = args[0], tape.slots
            hit = self._produced(tape, a, output)
            if hit is not None:
                ins = (hit[1:4],)
                lo, hi = hit[1], hit[2]
            else:
                lo, hi = slots.minmax(a.detach(), LOOSE)
                ins = ((lo, hi, False),)
            ra, rb = slots.relu(lo, hi, NAN_ONLY if allowed else STRICT)
            tape.cache[id(output)] = (weakref.ref(output), ra, rb, allowed, _version_of(output))
            mb = len(tape.micro_batches) - 1
            tape.calls.append((idx, mb, len(tape.calls), ((ra, rb),), None, ins))
        except Exception as e:
            self._internal_error(e)
        return None

    @staticmethod
    def _produced(tape: Tape, t: torch.Tensor, made_here=None) -> tuple | None:
        """The cache entry of the output (or root input) ``t`` is, or is a whole view of,
        if it is unchanged since (or changed in place by the call that returned it)."""
        hit = tape.cache.get(id(t))
        # (a recorded version None: an inference-mode tensor, whose changes are unknown)
        if hit is not None and hit[0]() is t and (
                t is made_here or (hit[4] is not None and hit[4] == t._version)):
            return hit
        base = t._base  # a flatten/view of an output, covering exactly its elements
        if base is None:
            return None
        hit = tape.cache.get(id(base))
        if hit is not None and hit[0]() is base and hit[4] is not None \
                and hit[4] == base._version \
                and t.numel() == base.numel() and t.storage_offset() == base.storage_offset() \
                and t.is_contiguous() and base.is_contiguous():
            return hit
        return None

    def _input_refs(self, tape: Tape, args, kwargs, made_here=None) -> tuple:
        """(min, max, allowed) refs of each floating input of an inner call (kept, never
        checked); an input that an earlier call produced reuses that call's statistics, so a
        chain of modules costs nothing here.

        Inputs are seen after the call: one changed in place since it was produced is
        measured again, unless this call returned it (an in-place module: the produced
        statistics are its input's)."""
        refs = []
        for t in _leaves(args, kwargs):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            hit = self._produced(tape, t, made_here)
            if hit is not None:
                refs.append(hit[1:4])
                continue
            buf = self._allowed_buffers.get(id(t))
            allowed = buf is not None and buf() is t
            # Only "were they finite" matters for an inner call's inputs: a sum says it in
            # half an aminmax's time (NaN/Inf survive a sum; float32 accumulation)
            ref = tape.slots.total(t.detach(), LOOSE)
            refs.append((ref, ref, allowed))
        return tuple(refs)

    def _root_input_refs(self, tape: Tape, args, kwargs) -> tuple:
        """(min, max, allowed) refs of each floating root input. NaN is always checked; +-Inf
        only with ``strict_inf`` and outside ``allow_inf`` (by the argument's name, ``args[i]``
        or a keyword, or an allowed buffer passed in): by default an infinity that comes in
        (a float mask) is an event only where it leads (see ``strict_inf``). Each is cached,
        so the first layers that take it reuse these."""
        refs = []
        for name, t in _named_leaves(args, kwargs):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            hit = self._produced(tape, t)
            if hit is not None:
                refs.append(hit[1:4])
                continue
            if self.strict_inf:
                buf = self._allowed_buffers.get(id(t))
                soft = (buf is not None and buf() is t) or self._is_allowed(name)
            else:
                soft = True
            a, b = tape.slots.minmax(t.detach(), NAN_ONLY if soft else STRICT)
            refs.append((a, b, soft))
            tape.cache[id(t)] = (weakref.ref(t), a, b, soft, _version_of(t))
        return tuple(refs)

    def _output_refs(self, tape: Tape, output, allowed: bool):
        """((min, max) refs per floating output tensor, (sum, 2-norm, numel) refs of the first
        with ``stats="full"``)."""
        full = self._param_norms
        outs, stats = [], None
        for t in (output,) if type(output) is torch.Tensor else tensor_leaves(output):
            ref = self._output_ref(tape, t, allowed, reuse=not full)
            if ref and full and stats is None:  # sum and 2-norm: far cheaper than std_mean
                d = t.detach()
                stats = (tape.slots.total(d, LOOSE), tape.slots.norm(d, LOOSE), t.numel())
            outs += ref
        return tuple(outs), stats

    @staticmethod
    def _output_ref(tape: Tape, t: torch.Tensor, allowed: bool, reuse: bool) -> tuple:
        """``((min ref, max ref),)`` of one output tensor, or ``()`` if it is not floating.
        ``reuse``: an output passed through unchanged (a Sequential's) keeps the statistics of
        the call that made it."""
        if not t.is_floating_point() or t.numel() == 0:
            return ()
        hit = tape.cache.get(id(t))
        if (reuse and hit is not None and hit[0]() is t and hit[4] is not None
                and hit[4] == t._version and hit[3] == allowed):
            return (hit[1:3],)
        a, b = tape.slots.minmax(t.detach(), NAN_ONLY if allowed else STRICT)
        tape.cache[id(t)] = (weakref.ref(t), a, b, allowed, _version_of(t))
        return ((a, b),)

    def _loss_post_hook(self, module, args, kwargs, output):
        tape = self._tape
        if tape is None and self._eval_tail is not None and self._active:
            tape, self._eval_tail = self._eval_tail, None
            return self._check_evaluation_loss(tape, args, kwargs, output)
        if not self._active or tape is None or not tape.micro_batches:
            return None
        try:
            self._record_loss(tape, args, kwargs, output)
        except Exception as e:
            self._internal_error(e)
        return None

    @staticmethod
    def _record_loss(tape: Tape, args, kwargs, output) -> None:
        """The loss call's arguments (the targets, kept by reference) on the micro-batch, and
        the (min, max) of each floating output among the step's must-be-finite statistics."""
        mb = tape.micro_batches[-1]
        mb.loss_args, mb.loss_kwargs = args, kwargs
        FlightRecorder._loss_stats(tape, output)

    @staticmethod
    def _loss_stats(tape: Tape, output) -> None:
        for t in tensor_leaves(output):
            if t.is_floating_point() and t.numel():
                lo, hi = tape.slots.minmax(t.detach(), STRICT)
                tape.loss.append((tape.micro_batch, lo, hi))

    def _check_evaluation_loss(self, tape: Tape, args, kwargs, output) -> None:
        """The loss of an evaluation forward (already checked and closed): its row again, with
        the loss, and one more host read; the event is then a loss event of that forward."""
        try:
            self._record_loss(tape, args, kwargs, output)
            if not tape.loss:
                return
            layout, row, probe, _ = self._build_row(tape, skipped=False)
            ok, _ = _read_probe(probe)  # the evaluation loss's own host read
        except Exception as e:
            self._internal_error(e)
            return
        if not ok and not self._fired:
            self._event(tape, layout, row, "non_finite")

    def _grad_hook(self, i: int, p: torch.Tensor) -> None:
        """Squared norms of a gradient (and, with ``stats="full"``, its parameter) when backward
        has written it: used where the optimizer's pre-hook may not run before the gradient is
        gone (no optimizer; a GradScaler that skips the update), see ``attach``."""
        tape = self._tape
        if not self._active or tape is None or p.grad is None or p.grad.layout != torch.strided:
            return
        try:
            grad = p.grad
            g = tape.slots.sq_norm(grad.detach(), GRAD)
            w = tape.slots.sq_norm(p.detach(), STRICT) if self._param_norms else None
            with tape.lock:  # accumulation: the last call sees the accumulated gradient
                tape.grad_norms[i] = g
                if w is not None:
                    tape.param_norms[i] = w
                tape.grad_seen[i] = (id(grad), grad._version)
        except Exception as e:
            self._internal_error(e)

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        if not self._active:
            return None
        # (``args`` holds the optimizer itself first: the hook wraps the unbound step)
        closure = kwargs.get("closure") if "closure" in kwargs else (
            args[1] if len(args) > 1 else None)
        if callable(closure):
            # step(closure): the step's forward and backward run inside step(), in the closure
            # (Lightning's automatic optimization, LBFGS): close the step when it returns,
            # still before the update
            wrapped = partial(self._after_closure, optimizer, closure, [False])
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._before_update(optimizer)
        return None

    def _after_closure(self, optimizer, closure, done: list, *args, **kwargs):
        result = closure(*args, **kwargs)
        if not done[0]:  # LBFGS evaluates again after updating: those join the next step
            done[0] = True
            self._before_update(optimizer)
        return result

    def _before_update(self, optimizer) -> None:
        """Close the step right before ``optimizer`` updates the weights."""
        tape = self._tape  # another thread may close it meanwhile: work on this one
        if not self._active:
            return
        self._updated = True  # the next step's weights come from this update
        self._eval_tail = None
        if tape is None:
            if self._unrooted_call is not None:
                self._unrooted()
            return
        try:
            self._reread_changed_grads(tape)  # small parameters: when the row is built
        except Exception as e:
            self._internal_error(e)
        self._close_tape(at="optimizer")
        if self.guard_optimizer and not self._fired:
            self._guard = _copy_for_guard(optimizer, self._params)
            self._last_tape = tape

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        """Evidence of what the update wrote: the squared norm of every weight the optimizer
        holds, on the device, read with the next step's host read (see _build_row). Guard
        mode checks them now instead (the mode's second sync)."""
        if not self._active:
            return None
        if not self.guard_optimizer:
            try:
                self._measure_update()
            except Exception as e:
                self._internal_error(e)
            return None
        if self._guard is not None and not self._fired:
            norms = _norms([(i, p) for i, (_, p) in enumerate(self._params)])
            values = torch.stack([n for _, n in norms]).tolist()  # guard mode's 2nd sync
            bad = [self._params[i][0] for (i, _), v in zip(norms, values)
                   if not math.isfinite(v)]
            if bad:
                self._optimizer_event(bad)
            else:
                self._updated = False  # verified: weights bad by the next step were not its doing
        return None

    def _measure_update(self) -> None:
        """Squared norms of the weights right after an update into slots of their own (one dot
        per large weight, one foreach call for many small ones); no host read."""
        large, small = self._update_large, self._update_small
        if not large and not small:
            return
        device = (large or small)[0][1].device
        slots = self._update_slots
        if slots is None or slots.device != device:
            slots = self._update_slots = Slots(device, len(large) + len(small) + 8)
        slots.start_step()
        with torch.no_grad():
            refs = list(zip((i for i, _ in large),
                            slots.sq_norm_each([p.detach() for _, p in large], STRICT)))
            if small:
                refs += zip((i for i, _ in small),
                            slots.sq_norms([p.detach() for _, p in small], STRICT))
        # the update belongs to the step the pre-hook just closed
        self._pending_update = (self._step - 1, refs)

    def _check_last_update(self) -> None:
        """At detach after a clean exit: the last update's evidence, which no next step will
        read (one host read, once)."""
        pending, self._pending_update = self._pending_update, None
        if pending is None or self._fired or not self._active:
            return
        step, refs = pending
        values = self._update_slots.gather()[STRICT].tolist()  # the detach's one read
        bad = [self._params[i][0] for i, (_, k) in refs if not math.isfinite(values[k])]
        if bad:
            self._optimizer_event(bad, step=step, after_update=True)

    # ------------------------------------------------------------------------------------------
    # step lifecycle

    def _begin_micro_batch(self, args, kwargs, training: bool) -> None:
        self._eval_tail = None  # an evaluation forward whose loss never came
        with self._lock:
            tape = self._tape
            if tape is not None and (tape.evaluation  # one whose forward raised
                                     or self._step_ended_without_optimizer(tape)):
                self._close_tape(at="forward")
                tape = None
            if tape is None:
                # Between steps, a forward in eval mode with gradients off is an evaluation:
                # checked on its own when it returns, and part of no step (see _post_hook).
                tape = self._open_tape(evaluation=self._optimizer is not None and not training
                                       and not torch.is_grad_enabled())
            mb = MicroBatch(args=args, kwargs=kwargs, grad_enabled=torch.is_grad_enabled(),
                            autocast=_autocast_state())
            mb.input_refs = self._root_input_refs(tape, args, kwargs)
            tape.micro_batches.append(mb)

    def _step_ended_without_optimizer(self, tape: Tape) -> bool:
        if self._optimizer is None:
            return True
        if self._skipped_by_scaler(tape):
            return True
        return len(tape.micro_batches) >= self.max_micro_batches

    def _skipped_by_scaler(self, tape: Tape) -> bool:
        """scaler.update() ran since the step opened and optimizer.step() did not (it would
        have closed the step): a step the GradScaler skipped, wherever it gets closed (the
        next forward, or detach when it was the loop's last)."""
        return (self._optimizer is not None and self._scaler is not None
                and tape.scaler_token != _scaler_token(self._scaler()))

    def _open_tape(self, evaluation: bool = False) -> Tape:
        token = _scaler_token(self._scaler()) if self._scaler is not None else None
        slots = self._slots
        device = self._params[0][1].device if self._params else _CPU
        if slots is None or slots.device != device:  # first step, or the model moved
            slots = self._slots = Slots(device)
        slots.start_step()
        tape = Tape(self._step, self._capture_rng(), token, slots)
        tape.evaluation = evaluation
        tape.params_from_update = self._updated
        if not evaluation:  # the next training step's weights still come from that update
            self._updated = False
        self._snapshot_buffers(tape)
        self._tape = tape
        self._unrooted_call = None
        return tape

    def _snapshot_buffers(self, tape: Tape) -> None:
        """Keep the pre-step value of buffers that forwards change (BatchNorm statistics).

        A buffer is copied at the start of a step when it is new or changed since the last
        start (its version counter moved), so static ones (masks) cost nothing; the copy of
        one that did not move still holds its pre-step value. BatchNorm statistics, which
        change without moving the counter, are copied every time.
        """
        if self._volatile_copies:
            with torch.no_grad():
                torch._foreach_copy_(self._volatile_copies[1], self._volatile_copies[0])
            tape.copied_buffers.update(self._volatile_buffers)
        src, dst = [], []
        for name, b in self._steady_buffers:
            version = _version_of(b)
            if b.numel() == 0 or (version is not None
                                  and self._buffer_versions.get(name) == version):
                continue
            copy = self._buffer_copies.get(name)
            if copy is None or copy.shape != b.shape or copy.dtype != b.dtype:
                copy = self._buffer_copies[name] = torch.empty_like(b)
            src.append(b)
            dst.append(copy)
            self._buffer_versions[name] = version
            tape.copied_buffers.add(name)
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)

    def _end_micro_batch(self, tape: Tape, output) -> None:
        mb = tape.micro_batches[-1]
        mb.outputs = output
        if torch.is_grad_enabled():
            for i, t in enumerate((output,) if type(output) is torch.Tensor
                                  else tensor_leaves(output)):
                fn = t.grad_fn
                if fn is not None:  # a pre-hook on its node: a tenth of register_hook's Python
                    fn.register_prehook(partial(_keep_out_grad, mb.out_grads, i, t.output_nr))
                elif t.requires_grad:
                    t.register_hook(partial(_keep_grad, mb.out_grads, i))

    def _close_open_step(self, at: str) -> None:
        if self._active and self._tape is not None:
            self._close_tape(at=at)

    def _close_tape(self, at: str) -> None:
        """Check the step with one host read; on an event, write the bundle."""
        with self._lock:
            tape = self._tape
            if tape is None:
                return
            self._tape = None
            if not tape.evaluation:
                self._step += 1
        try:
            layout, row, probe, scale = self._build_row(
                tape, skipped=not tape.evaluation and self._skipped_by_scaler(tape))
        except Exception as e:
            self._internal_error(e)
            return
        ok, read_scale = _read_probe(probe)  # the one host-device sync of the step
        if scale:
            layout.scale = read_scale
        if tape.evaluation:  # the ring is the training steps' history: its row is not kept
            if not ok and not self._fired:
                self._event(tape, layout, row, "non_finite")
            return
        self._ring.commit(layout)
        reason = None
        if not ok:
            reason = "non_finite"
        elif self._scaler is not None:
            self._skips = self._skips + 1 if layout.skipped else 0
            if layout.scale is not None and layout.scale < self.min_scale:
                reason = "scale_collapse"
            elif self._skips > self.max_skipped_steps:
                reason = "scale_skipping"
        if reason is not None and not self._fired:
            self._event(tape, layout, row, reason)

    def _small_param_norms(self, tape: Tape) -> None:
        """Squared norms of the small parameters and their gradients, two foreach calls."""
        idx = [i for i in self._small if i not in tape.grad_norms
               and self._params[i][1].grad is not None
               and self._params[i][1].grad.layout == torch.strided]
        if not idx:
            return
        params = [self._params[i][1] for i in idx]
        with tape.lock:
            tape.grad_norms.update(zip(idx, tape.slots.sq_norms(
                [p.grad.detach() for p in params], GRAD)))
            if self._param_norms:
                tape.param_norms.update(zip(idx, tape.slots.sq_norms(
                    [p.detach() for p in params], STRICT)))

    def _reread_changed_grads(self, tape: Tape) -> None:
        """Norms of the gradients the optimizer will use. With backward hooks, only those that
        changed since backward wrote them: DDP's all-reduced average, GradScaler's unscaled
        values, clipping, a replaced tensor. Small parameters: see _small_param_norms."""
        seen = tape.grad_seen
        every = not self._grad_hooks or self._ddp or self._scaler is not None
        strided = torch.strided
        idx, grads = [], []
        # last parameter first: the optimizer starts with the first, whose gradient is then
        # the one still in cache
        for i, p in reversed(self._large):
            grad = p.grad
            if grad is None or grad.layout is not strided:
                continue
            if every or seen.get(i) != (id(grad), grad._version):
                idx.append(i)
                grads.append(grad.detach() if grad.requires_grad else grad)
        if not idx:
            return
        with tape.lock:
            tape.grad_norms.update(zip(idx, tape.slots.sq_norm_each(grads, GRAD)))
            tape.grads_reread = True
            if self._param_norms and not self._grad_hooks:
                weights = [self._params[i][1].detach() for i in idx]
                tape.param_norms.update(zip(idx, tape.slots.sq_norm_each(weights, STRICT)))

    def _build_row(self, tape: Tape, skipped: bool):
        """Copy the step's statistics into the next ring row and compute, still on the device,
        a probe (see :func:`_read_probe`): three device ops, as this runs every step. Returns
        (layout, row, probe, scale): ``row`` is the whole step's (the ring keeps it cut when it
        is wider than the ring), ``scale`` whether the probe carries the GradScaler's scale,
        read in the same sync."""
        if not tape.evaluation:  # an evaluation's gradients are the last step's, already read
            self._small_param_norms(tape)
        opt = self._optimizer() if self._optimizer else None
        lrs = [_host_float(g["lr"]) for g in opt.param_groups] if opt is not None else []
        layout = StepLayout(step=tape.step, lrs=lrs, skipped=skipped,
                            grads_scaled=self._scaler is not None and not tape.grads_reread)
        slots = tape.slots
        pieces = slots.gather()  # the regions, in row order
        s, g, n, loose = (p.numel() for p in pieces)
        # the last update's evidence goes right after the must-be-finite entries, so the same
        # probe checks it: [STRICT, update, GRAD, NAN_ONLY, LOOSE]
        pending = None if tape.evaluation else self._pending_update
        updates: list = []
        u = 0
        if pending is not None:
            self._pending_update = None
            layout.update_step, updates = pending
            piece = self._update_slots.gather()[STRICT]
            if piece.device == slots.device:
                pieces.insert(1, piece)
                u = piece.numel()
            else:  # the model moved since: that evidence is void
                updates = []
        # Indices into the row are resolved only when a row is decoded (events, export).
        layout.raw = (list(tape.calls), list(tape.loss), sorted(tape.grad_norms.items()),
                      sorted(tape.param_norms.items()), (0, s + u, s + u + g, s + u + g + n),
                      updates, s)
        s += u  # from here, "s" spans the strict entries and the update's
        total = s + g + n + loose
        row = self._ring.reserve(total, slots.device)
        full = row
        if row.numel() == total and row.device == slots.device:
            if total:
                torch.cat(pieces, out=row)
        else:  # a row longer than the ring is wide (stored truncated, checked whole), or a
            full = torch.cat(pieces)  # model moved to another device after the first step
            row.copy_(full[: row.numel()])
        # gradient norms of a step the GradScaler skipped are expected to overflow: unchecked
        checked = s if skipped else s + g
        probe = self._probe
        if probe is None or probe.device != full.device:
            probe = self._probe = torch.zeros(4, dtype=torch.float32, device=full.device)
            self._probe_views = probe.unbind(0)
            self._probe_nan_only = False
        finite, lo, hi, scale_out = self._probe_views
        if full is row and checked:
            self._ring.probe_finite(checked, out=finite)
        else:
            finite.copy_(full[:checked].mul(0).sum())
        if n:  # entries that may hold +-Inf: only NaN counts, which aminmax propagates
            torch.aminmax(full[s + g: s + g + n], out=(lo, hi))
        elif self._probe_nan_only:  # the last step had such entries, this one has none
            lo.zero_()
        self._probe_nan_only = bool(n)
        scaler = self._scaler() if self._scaler is not None else None
        scale = getattr(scaler, "_scale", None)
        if scale is not None:
            scale_out.copy_(scale.reshape(()))
        return layout, full, probe, scale is not None

    # ------------------------------------------------------------------------------------------
    # events

    def _event(self, tape: Tape, layout: StepLayout, row: torch.Tensor, reason: str) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        host = row.tolist()
        event = events.find_event(
            host, layout, tape, reason=reason, module_names=self._module_names,
            module_types=self._module_types, param_names=[n for n, _ in self._params],
            params_from_update=tape.params_from_update,
            allowed={i for i, n in enumerate(self._module_names) if self._is_allowed(n)},
            strict_inf=self.strict_inf,
            param_tensors=[p for _, p in self._params])
        if event is None:  # false alarm: norms of huge but finite tensors overflowed
            with self._lock:
                self._fired = False
            return
        if tape.evaluation:
            event["evaluation"] = True
        if event.get("module") in self._compiled:
            event["compiled"] = True  # its layers were not recorded (see recorder.compiled)
        self._write_and_report(tape, event)

    def _optimizer_event(self, bad: list[str], step: int | None = None,
                         after_update: bool = False) -> None:
        names = set(bad)
        # norms overflow float32 for finite values above ~1.8e19: the weights decide
        pairs = [(n, p) for n, p in self._params
                 if n in names and not bool(torch.isfinite(p).all())]
        if not pairs:
            return
        bad, live = [n for n, _ in pairs], [p for _, p in pairs]
        with self._lock:
            if self._fired:
                return
            self._fired = True
        event = events.optimizer_event(self._step - 1 if step is None else step, bad,
                                       after_update=after_update,
                                       kind=events.tensors_kind(live) or "nan")
        if after_update:  # the weights are those the update left; no step's batch with them
            self._write_and_report(None, event)
            return
        tape = self._last_tape
        self._write_and_report(tape, event, guard=self._guard)

    def _write_and_report(self, tape: Tape | None, event: dict[str, Any], guard=None) -> None:
        self.event = event
        rank, world = distributed_rank()
        try:
            meta, tensors = build_bundle(self, tape, event, guard=guard, rank=rank,
                                         world_size=world)
            from .bundle import write_bundle

            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = write_bundle(self.out_dir, f"step{event['step']:08d}-rank{rank}", meta,
                                tensors)
        except Exception as e:
            msg = events.summary(event, None) + f" Writing the bundle failed: {e}"
            if self.on_event == "raise":
                raise NonFiniteError(msg, event=event, write_error=e) from e
            log.warning(msg)
            return
        self.bundle_path = path
        msg = events.summary(event, path)
        if self.on_event == "raise":
            self._active = False
            raise NonFiniteError(msg, bundle_path=path, event=event)
        log.warning(msg)

    def _unrooted(self) -> None:
        """An update with no forward of the recorded model since the last one, while one of its
        submodules ran: the loop calls parts of the model (a LightningModule's training_step
        calling ``self.encoder``), so no step ever opens and nothing is checked. Said once."""
        name = self._module_names[self._unrooted_call]
        self._unrooted_call = None
        if self._unrooted_warned:
            return
        self._unrooted_warned = True
        log.warning("nanreplay: optimizer.step() ran with no forward of the recorded model since "
                    "the last step, while its submodule '%s' ran on its own: nothing is recorded "
                    "or checked. %s", name, self._unrooted_advice)

    def _internal_error(self, e: Exception) -> None:
        self._internal_errors += 1
        if self._internal_errors == 1:
            log.warning("nanreplay: recorder disabled after an internal error (%s: %s); "
                        "training continues unrecorded", type(e).__name__, e)
        self._active = False

    def _is_allowed(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pat) for pat in self.allow_inf)

    def _inf_allowed(self, idx: int, name: str) -> bool:
        """Whether module ``idx``'s outputs may hold +-Inf (only NaN checked): any module but
        the root by default, only ``allow_inf`` ones with ``strict_inf``."""
        return (idx != 0 and not self.strict_inf) or self._is_allowed(name)


# ----------------------------------------------------------------------------------------------
# helpers


def _named_leaves(args, kwargs):
    """(top-level name, tensor) of every tensor in a call's arguments: ``args[i]`` or the
    keyword, for tensors nested inside one too."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            yield f"args[{i}]", a
        elif isinstance(a, (list, tuple, dict)):
            for t in tensor_leaves(a):
                yield f"args[{i}]", t
    for k, v in (kwargs or {}).items():
        if isinstance(v, torch.Tensor):
            yield str(k), v
        elif isinstance(v, (list, tuple, dict)):
            for t in tensor_leaves(v):
                yield str(k), t


def _leaves(args, kwargs):
    for a in args:
        if type(a) is torch.Tensor or isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple, dict)):
            yield from tensor_leaves(a)
    if kwargs:
        yield from tensor_leaves(kwargs)


def _version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference-mode tensor, which keeps no version counter (so
    whether it changed in place is unknown: it is measured again, its buffer copied again)."""
    return None if t.is_inference() else t._version


def _keep_grad(store: dict, i: int, grad: torch.Tensor) -> None:
    store[i] = grad


def _keep_out_grad(store: dict, i: int, nr: int, grad_outputs: tuple) -> None:
    grad = grad_outputs[nr]
    if grad is not None:
        store[i] = grad


def _norms(indexed_params) -> list[tuple[int, torch.Tensor]]:
    idx, tensors = [], []
    for i, t in indexed_params:
        if t is None or t.layout != torch.strided or t.numel() == 0:
            continue
        idx.append(i)
        tensors.append(t.detach())
    if not tensors:
        return []
    with torch.no_grad():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return list(zip(idx, norms))


def _read_probe(probe: torch.Tensor) -> tuple[bool, float]:
    """The step's one host read: ``probe`` is [0 if every must-be-finite entry is finite else
    NaN, min and max of the entries where only NaN counts, the GradScaler's scale]. Returns
    (all checks pass, scale)."""
    finite, lo, _, scale = probe.tolist()
    return finite == 0.0 and not math.isnan(lo), scale


def _host_float(x) -> float:
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" else math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _scaler_token(scaler) -> int | None:
    # GradScaler.update() replaces this dict; seeing a new one means a step ended, skipped or not.
    return id(getattr(scaler, "_per_optimizer_states", None)) if scaler is not None else None


def _add_note(exc: BaseException, text: str) -> None:
    """``exc.add_note(text)`` (Python 3.11+), else a warning in the log."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        log.warning(text)


def _autocast_state() -> dict[str, Any]:
    out = {}
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            out[dev] = str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
    return out


def _copy_for_guard(optimizer, params) -> dict[str, Any]:
    names = {id(p): n for n, p in params}
    copies: dict[str, Any] = {"weights": {}, "grads": {}, "state": {}, "tensors": []}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                n = names.get(id(p))
                if n is None:
                    continue
                copies["weights"][n] = p.detach().clone()
                if p.grad is not None:
                    copies["grads"][n] = p.grad.detach().clone()
                st = optimizer.state.get(p, {})
                copies["state"][n] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                      for k, v in st.items()}
    for d in (copies["weights"], copies["grads"]):
        copies["tensors"].extend(d.values())
    for st in copies["state"].values():
        copies["tensors"].extend(v for v in st.values() if isinstance(v, torch.Tensor))
    copies["hyper"] = [{k: v for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]
    return copies
