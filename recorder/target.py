"""What is recorded: the model as written (unwrapped from DDP and compile wrappers), its hook
sites, parameters, buffers and their names, and the optimizer, GradScaler and scheduler that
go with it, all held weakly so the recorder never keeps a model alive. Under torch.distributed,
also the ranks it trains with (:mod:`recorder.ranks`); under FSDP2 its parameters are DTensors,
of which the recorder measures the local shards only (:func:`recorder.shards.local`).

The names and index lists are fixed at :meth:`Target.bind` (the recorder's ``attach``): the
statistics of every step refer to modules and parameters by their index in these lists.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from .attributes import AttributeWatch, loss_objects
from .compat import (
    any_autocast_enabled,
    forward_autocasts,
    is_norm_layer,
    own_slots,
    version_of,
    view_base,
)
from .compiled import HookSite, eager_name, hook_sites, unwrap
from .constants import inf_constants
from .finite import matches
from .ranks import Agreement
from .replaced import bad_kinds, group_heads, heads_moved, swapped
from .rng import module_generators
from .running_stats import RunningStats
from .samples import recurrent, seq_first
from .settings import Settings
from .shards import class_name, local, sharded
from .stale_grads import grad_keys

log = logging.getLogger("nanreplay")

_SMALL = 1 << 15  # parameters with fewer elements get batched norms...
_FEW = 16  # ...when there are more than this many of them

_UNROOTED_ADVICE = ("Give FlightRecorder the module whose forward your training step calls "
                    "(or call the model itself)")


def _ref(obj):
    return weakref.ref(obj) if obj is not None else None


def _deref(ref):
    return ref() if ref is not None else None


_NONE = type(None)  # called, returns None: the "weak reference" to no object


def _getter(obj):
    """A weak reference to ``obj``, or for None a callable returning None: the object's
    getter, called as a method is."""
    return weakref.ref(obj) if obj is not None else _NONE


LOSS_PREFIX = "<loss>."  # how the parameters of the loss module are named among the model's


def loss_params(loss_fn, optimizer, params: list) -> list[tuple[str, torch.Tensor]]:
    """The parameters of the loss module that the optimizer trains (a learnable temperature,
    a multi-task loss's log-variances), named ``<loss>.NAME``: recorded, checked and bundled
    as the model's are, so the replay restores and updates them too. Those another optimizer
    trains stay the loss's own tensors (``loss/NAME``, see recorder.lossdesc)."""
    if loss_fn is None or optimizer is None:
        return []
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    own = {id(p) for _, p in params}
    return [(LOSS_PREFIX + eager_name(n), p) for n, p in loss_fn.named_parameters()
            if id(p) in held and id(p) not in own]


class Target:
    """The recorded model and the objects that train it."""

    def __init__(self, model: nn.Module, optimizer, scaler, lr_scheduler, settings: Settings,
                 loss_fn=None):
        # DistributedDataParallel / DataParallel / torch.compile: record the wrapped module, so
        # names and the factory are the user's model; DDP all-reduces gradients after backward
        # wrote them, so their norms are re-read before the update (see recorder.grads).
        model, wrapper, self.ddp = unwrap(model)
        self._model, self._wrapper = weakref.ref(model), _ref(wrapper)
        # the model and the objects that train it, or None: each a getter called as a method
        # is (weak references: the recorder keeps none of them alive)
        self.model, self.optimizer = self._model, _getter(optimizer)
        self.scaler, self.scheduler = _getter(scaler), _getter(lr_scheduler)
        self._loss_fn = _ref(loss_fn if isinstance(loss_fn, nn.Module) else None)
        self._plain_loss = None if isinstance(loss_fn, nn.Module) else loss_fn  # (its watch's)
        self.has_optimizer = optimizer is not None
        self.has_scaler = scaler is not None
        self.settings = settings
        self.compiled_elsewhere = False  # set by a Trainer callback whose Trainer compiles
        # what to do when only submodules run (a Trainer callback names its own option)
        self.unrooted_advice = _UNROOTED_ADVICE
        self.unknown_warned = False  # about parameters added to the model after attach
        self.replaced_warned = False  # about hooked modules the model replaced since
        self.constants: dict[int, torch.Tensor] = {}  # frozen ±inf parameters (mask values)
        self.module_names: list[str] = []
        self.module_types: list[str] = []
        self.compiled: set[str] = set()
        self.allowed_modules: set[int] = set()
        self.seq_first = False
        self.recurrent = False
        self.grad_hooks = True
        # normalization layers' running statistics, checked as each training step closes
        self.running_stats = RunningStats()
        self.release()

    def loss_module(self) -> nn.Module | None:
        """The loss module the recorder was given (None for none, or a plain function)."""
        return _deref(self._loss_fn)

    def given(self) -> nn.Module | None:
        """What the recorder was given: the model, or the wrapper it was unwrapped from."""
        wrapper = _deref(self._wrapper)  # (not ``or``: a compile wrapper refuses len())
        return wrapper if wrapper is not None else self._model()

    def module_ids(self) -> dict[int, str]:
        """The model's modules by id, named (the wrapper it was given too, as the root): what
        a loss given the model itself is bundled as (``recorder.entries``)."""
        model = self._model()
        named = {} if model is None else {id(m): n for n, m in model.named_modules()}
        if (given := self.given()) is not None:
            named.setdefault(id(given), "")
        return named

    def _read_forward_autocast(self, model: nn.Module) -> None:
        """The autocast the root's forward enters itself (accelerate's mixed precision wraps
        it so), which its pre-hook, where a micro-batch's autocast is read, does not see yet;
        and which forward that was (an instance attribute, or None for the class's)."""
        self.forward_autocast = [(d, str(t).removeprefix("torch.") if on else None)
                                 for d, t, on in forward_autocasts(model.forward)
                                 if d in ("cpu", "cuda")]
        self._forward_id = id(model.__dict__.get("forward"))

    def root_autocast(self, model: nn.Module | None) -> list[tuple[str, str | None]]:
        """``forward_autocast``, read again when the model's forward was replaced since attach
        (``accelerator.prepare(model)`` after the recorder attached wraps it in autocast):
        one dict lookup per root forward otherwise."""
        if model is not None and id(model.__dict__.get("forward")) != self._forward_id:
            self._read_forward_autocast(model)
        return self.forward_autocast

    def bind(self) -> list[HookSite]:
        """Fix the names and index lists (at attach); returns the hook sites, root first."""
        model = self._model()
        if model is None:
            raise RuntimeError("FlightRecorder.attach: the model no longer exists")
        sites = hook_sites(model, _deref(self._wrapper), self.compiled_elsewhere)
        self.sites = sites
        self.module_names = [s.name for s in sites]
        self.module_types = [class_name(s.module) for s in sites]  # (not FSDP's FSDP<Class>)
        # the loop may change them; the bundle keeps those it did (see .attributes)
        loss = _deref(self._loss_fn)  # (and the loss's own, as the step began: a running mean)
        self.attributes = AttributeWatch(sites, self._plain_loss if loss is None else loss)
        # generators the model or loss keeps (a diffusion model drawing its timesteps and
        # noise with generator=self.gen): their states are captured with the global ones
        self.generators = module_generators(
            [(s.name, s.module) for s in sites]
            + ([] if loss is None else loss_objects(loss)))
        self.compiled = {s.name for s in sites if s.region}  # recorded as one call each
        self.passing = {s.name for s in sites[1:] if s.target is not None and not s.region
                        and passes_through(s.module)}  # not hooked: their calls repeat others'
        self.allowed_modules = {i for i, n in enumerate(self.module_names) if self.is_allowed(n)}
        self.seq_first = seq_first(model)  # the samples of its batches are in dim 1
        self.recurrent = recurrent(model)  # (and of its hidden states, whatever the above)
        self._read_forward_autocast(model)
        # (not a parameter on the meta device: a placeholder that holds no value, such as a
        # main network whose weights a hypernetwork makes, swapped in by functional_call)
        self.params = [(eager_name(n), p) for n, p in model.named_parameters() if not p.is_meta]
        self.params += loss_params(_deref(self._loss_fn), self.optimizer(), self.params)
        # FSDP2 may keep accumulated gradients outside p.grad until it reduces them
        self.sharded = sharded(model)
        self.param_names = [n for n, _ in self.params]
        # where each buffer lives (its module's buffer dict and key), not the tensor: a forward
        # may put a new tensor there (a rotary cache grown for a longer batch, ``self.count =
        # self.count + 1``), and the recorder must copy the one the model holds now
        self.buffer_homes = buffer_homes(model)
        # and the loss module's, under their bundle keys: a loss that keeps state (DINO's
        # centre, replaced at each call) is bundled as the step found it, like the model's
        loss = _deref(self._loss_fn)
        self.loss_buffer_homes = [(f"loss/{n}", home, key) for n, home, key in
                                  (buffer_homes(loss) if loss is not None else [])]
        # BatchNorm-style layers update their running statistics inside the kernel, which
        # does not move the version counter: their buffers are copied at every step start.
        self.norm_buffers = {f"{s.name}.{b}" if s.name else b for s in sites
                             if is_norm_layer(s.module)
                             for b, _ in s.module.named_buffers(recurse=False)}
        self.running_stats.bind(self.buffer_homes, self.norm_buffers)
        # a buffer is no call's output: its +-Inf (a registered causal mask) was not made in
        # the step, so by default it leaves a call's inputs finite, as allow_inf ones do
        self.allowed_buffers = {id(b): weakref.ref(b) for n, b in self.buffers
                                if not self.settings.strict_inf or self.is_allowed(n)}
        self._partition()
        # under torch.distributed: the run id and each step's agreement (waits for every rank)
        self.ranks = Agreement.join(self.device())
        return sites

    def _partition(self) -> None:
        """Which parameters get which kind of norm (see recorder.grads)."""
        opt = self.optimizer()
        # Gradient norms are read once, right before the update, in a tight loop (cheaper than
        # a hook per parameter, and they are then what the optimizer uses: after DDP's
        # all-reduce, GradScaler's unscale, clipping). Backward hooks take them instead where
        # that moment may never come: no optimizer (the step closes at the next forward, after
        # the user's own update and zero_grad), or a GradScaler that may skip the update.
        self.grad_hooks = opt is None or self.has_scaler
        held = {id(p) for g in opt.param_groups for p in g["params"] if not p.is_meta} \
            if opt is not None else set()  # (placeholders on the meta device: see bind)
        self.groups = len(opt.param_groups) if opt is not None else 0
        self.group_heads = group_heads(opt) if opt is not None else []
        self._warn_unknown(held)
        self.constants = inf_constants(self.params, held)  # (never weights gone bad)
        # The gradients to measure: of the parameters that train now, and of the frozen ones
        # the optimizer holds, which ``requires_grad_(True)`` may unfreeze later (a frozen
        # one has no gradient: it costs one attribute read per step).
        trained = [i for i, (_, p) in enumerate(self.params)
                   if p.requires_grad or id(p) in held]
        # Many small parameters are batched into one foreach call per step.
        small = [i for i in trained if self.params[i][1].numel() < _SMALL]
        self.small = small if len(small) > _FEW else []  # foreach only pays off for many
        self.small_params = [self.params[i][1] for i in self.small]
        batched = set(self.small)
        self.large = [(i, self.params[i][1]) for i in trained if i not in batched]
        # (their indices and tensors, last first: see recorder.grads.reread_changed_grads)
        self.large_last_first = ([i for i, _ in reversed(self.large)],
                                 [p for _, p in reversed(self.large)])
        self.update_small, self.update_large, self.unowned = [], [], []
        self.unowned_grads: list[tuple[int, int] | None] = []
        self.watched: torch.Tensor | None = None
        if opt is not None:  # the weights an update writes (see recorder.guard)
            # trained parameters the optimizer does not hold: another optimizer's (a
            # SparseAdam beside Adam) may update them before this one's step closes the step
            self.unowned = [(i, p) for i, (_, p) in enumerate(self.params)
                            if p.requires_grad and id(p) not in held]
            mine = [(i, p) for i, (_, p) in enumerate(self.params)
                    if id(p) in held and (p.is_floating_point() or p.is_complex())
                    and p.layout == torch.strided]
            # one weight it updates: moved in place while a step is open, another optimizer
            # stepped it (recorder.cycle.StepCycle.updated_elsewhere)
            self.watched = next((p for _, p in mine if p.requires_grad), None)
            few = [(i, p) for i, p in mine if p.numel() < _SMALL]
            self.update_small = few if len(few) > _FEW else []
            self.update_large = [(i, p) for i, p in mine
                                 if p.numel() >= _SMALL or not self.update_small]

    def _warn_unknown(self, held: set[int]) -> None:
        """Once: the optimizer holds parameters the model did not have at attach (a task
        head added since and given with ``add_param_group``), which nothing hooks, checks or
        bundles; attaching again reads the model anew."""
        unknown = held - {id(p) for _, p in self.params}
        model = self._model() if unknown else None
        if model is not None:  # (rare: a group added; those no longer in the model are stale)
            unknown &= {id(p) for p in model.parameters()}
            self._warn_replaced(model)
        if unknown and not self.unknown_warned:
            self.unknown_warned = True
            log.warning(UNKNOWN_WARNING.format(n=len(unknown)))

    def _warn_replaced(self, model: nn.Module) -> None:
        """Once: modules hooked at attach that the model holds no longer under their names (a
        layer swapped for a wider one, Net2Net): their replacements' calls are not recorded,
        though their parameters, followed by name (:meth:`follow_model`), are checked."""
        now = dict(model.named_modules())
        gone = [s.name for s in self.sites if s.name and now.get(s.name, s.module) is not s.module]
        if gone and not self.replaced_warned:
            self.replaced_warned = True
            log.warning(REPLACED_WARNING.format(names=", ".join(gone[:4])
                                                + (", ..." if len(gone) > 4 else "")))

    def rename(self) -> dict[str, str]:
        """Slow path: take the names the model gives the recorded parameters now, when the
        loop restructured it after attach (``torch.nn.utils.prune`` re-registers a pruned
        ``weight`` as ``weight_orig`` beside a ``weight_mask`` buffer, a parametrization as
        ``parametrizations.weight.original``), and its buffers added since (those masks):
        the bundle then describes the model that ran. Returns the old -> new names."""
        model = self._model()
        if model is None:
            return {}
        # (with an optimizer: those it swapped in this step. Without one the loop's own
        # update may have run since the forward read the old ones: the step's statistics
        # are of those, and the new ones would be blamed for what the update wrote)
        if self.has_optimizer and self.follow_model(model):
            self._partition()
        now = {id(p): eager_name(n) for n, p in model.named_parameters()}
        renamed = {n: now[id(p)] for n, p in self.params if now.get(id(p), n) != n}
        if renamed:
            self.params = [(renamed.get(n, n), p) for n, p in self.params]
            self.param_names = [n for n, _ in self.params]
            known = {n for n, _, _ in self.buffer_homes}
            self.buffer_homes += [h for h in buffer_homes(model) if h[0] not in known]
        return renamed

    def follow_optimizer(self) -> None:
        """Partition again when the optimizer has gained parameter groups since
        (``add_param_group``: layers unfrozen mid-run), or when a group's first parameter is
        another tensor (densification swapped new ones in: :meth:`follow_model` first), so
        that their gradients and updates are checked too (one ``len`` and one identity test
        per group, per step)."""
        opt = self.optimizer()
        if opt is None:
            return
        if len(opt.param_groups) != self.groups or heads_moved(opt, self.group_heads):
            model = self._model()  # (new groups may hold parameters swapped in by name)
            if model is not None:
                self.follow_model(model)
            self._partition()
        if self.unowned:  # (their gradients as the step opens: see recorder.stale_grads)
            self.unowned_grads = grad_keys(self.unowned)

    def follow_model(self, model: nn.Module) -> bool:
        """Take the tensors the model holds now under the recorded names of parameters it
        replaced (see :mod:`recorder.replaced`); their names join :attr:`replaced`, which the
        bundle lists. Returns whether any was replaced."""
        moved = swapped(model, self.params)
        for i, (name, p) in moved.items():
            self.params[i] = (name, p)
            self.replaced.add(name)
        if moved:  # (those swapped in non-finite: the loop's write, not the next update's)
            self.replaced_bad = bad_kinds(moved)
        return bool(moved)

    def release(self) -> None:
        """Drop every reference to parameters and buffers (at detach)."""
        self.sites: list[HookSite] = []
        self.attributes = AttributeWatch()
        self.generators: list[tuple[str, torch.Generator]] = []
        self.passing: set[str] = set()
        self.params: list[tuple[str, torch.Tensor]] = []
        self.param_names: list[str] = []
        self.buffer_homes: list[tuple[str, dict, str]] = []
        self.loss_buffer_homes: list[tuple[str, dict, str]] = []
        self.large: list[tuple[int, torch.Tensor]] = []
        self.large_last_first: tuple[list[int], list[torch.Tensor]] = ([], [])
        self.small: list[int] = []
        self.small_params: list[torch.Tensor] = []
        self.update_large: list[tuple[int, torch.Tensor]] = []
        self.update_small: list[tuple[int, torch.Tensor]] = []
        self.unowned: list[tuple[int, torch.Tensor]] = []
        self.unowned_grads: list[tuple[int, int] | None] = []  # (recorder.stale_grads)
        self.groups = 0  # the optimizer's parameter groups when last partitioned
        self.group_heads: list[torch.Tensor | None] = []  # (their first parameters)
        self.replaced: set[str] = set()  # parameters the loop swapped for new ones
        self.replaced_bad: dict[str, str] = {}  # (the last swap's non-finite ones: kinds)
        self.watched = None
        self.allowed_buffers: dict[int, weakref.ref] = {}
        self.norm_buffers: set[str] = set()
        self.ranks: Agreement | None = None

    def finite_flags(self) -> torch.Tensor | None:
        """Which parameters are finite now, as one device tensor (no host read), or None."""
        try:
            with torch.no_grad():
                device = self.device()
                flags = [torch.isfinite(local(p).detach()).all().to(device)
                         for _, p in self.params]
            return torch.stack(flags) if flags else None
        except (RuntimeError, NotImplementedError):  # a meta or otherwise unreadable weight
            return None

    def written_in_step(self, tape) -> list[int]:
        """Indices of the parameters that ``tape``'s step, one before the recorded
        optimizer's first update, made non-finite: finite when it opened, not now (a
        data-dependent init in the forward: ActNorm's scale from the first batch; later
        updates leave their own evidence). Slow path only: reads the flags and the weights."""
        if tape.finite_at_open is None:
            return []
        unowned = {i for i, _ in self.unowned}  # (changed_in_step's)
        return [i for (i, (_, p)), was in zip(enumerate(self.params),
                                               tape.finite_at_open.tolist())
                if was and i not in unowned and not bool(torch.isfinite(local(p).detach()).all())]

    def changed_in_step(self, tape) -> list[int]:
        """Indices of the trained parameters the optimizer does not hold that changed in place
        since ``tape``'s step began (another optimizer's ``step()``, an in-place edit); every
        trained one when an optimizer other than the recorded one stepped them all."""
        if tape.updated_elsewhere:
            return [i for i, (_, p) in enumerate(self.params) if p.requires_grad]
        return [i for (i, p), v in zip(self.unowned, tape.unowned_versions)
                if v is not None and version_of(p) != v]

    def device(self) -> torch.device:
        return self.params[0][1].device if self.params else torch.device("cpu")

    @property
    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each buffer, as the model holds them now."""
        return [(n, b) for n, home, key in self.buffer_homes
                if (b := home.get(key)) is not None]

    def is_allowed(self, name: str) -> bool:
        """``name`` matches an ``allow_inf`` pattern."""
        return matches(name, self.settings.allow_inf)

    def nan_allowed(self, name: str) -> bool:
        """Root input ``name`` matches an ``allow_nan`` pattern (missing values as NaN)."""
        return matches(name, self.settings.allow_nan)

    def inf_allowed(self, idx: int, name: str) -> bool:
        """Whether module ``idx``'s outputs may hold +-Inf (only NaN checked): any module but
        the root by default, only ``allow_inf`` ones with ``strict_inf``."""
        return (idx != 0 and not self.settings.strict_inf) or self.is_allowed(name)

    def allowed_buffer(self, t: torch.Tensor) -> bool:
        """``t`` is an allowed buffer (see ``allowed_buffers``) or a view of one (a causal
        mask sliced to the sequence, ``self.mask[:T, :T]``)."""
        ref = self.allowed_buffers.get(id(t))
        if ref is None and (base := view_base(t)) is not None:
            t, ref = base, self.allowed_buffers.get(id(base))
        return ref is not None and ref() is t


REPLACED_WARNING = (
    "nanreplay: the model replaced module(s) {names} since the recorder attached (a layer "
    "swapped for a new one): their parameters are followed by name and checked, but the new "
    "modules' calls are not recorded; call rec.detach() then rec.attach() after changing the "
    "model")

UNKNOWN_WARNING = (
    "nanreplay: the optimizer holds {n} parameter(s) that the model did not have when the "
    "recorder attached (a layer added since, given with add_param_group): they are neither "
    "checked nor bundled, and a bundle of the model cannot be replayed; call rec.detach() "
    "then rec.attach() after changing the model")


def buffer_homes(model: nn.Module) -> list[tuple[str, dict, str]]:
    """(name, the module's buffer dict, key) of each buffer, in ``named_buffers()``'s order
    (a buffer shared by two modules once; not one on the meta device, a placeholder's, which
    holds no value to copy)."""
    seen, homes = set(), []
    for prefix, m in model.named_modules():
        home = own_slots(m)[1]
        for key, b in home.items():
            if b is not None and id(b) not in seen and not b.is_meta:
                seen.add(id(b))
                homes.append((eager_name(f"{prefix}.{key}" if prefix else key), home, key))
    return homes


def passes_through(m: nn.Module) -> bool:
    """A module whose output is by construction another call's, unchanged: a plain
    ``nn.Sequential`` returns its last module's output, ``nn.Identity`` its input. Its record
    would repeat that call's statistics, so it is not hooked (a hook also takes every call of
    the module off PyTorch's fast path)."""
    t = type(m)
    return (t is nn.Sequential and len(m) > 0) or t is nn.Identity


def autocast_state(inner: list[tuple[str, str | None]]) -> dict[str, Any]:
    """Device type -> autocast dtype of the root's forward: the regions entered around the
    call, then ``inner``, those its forward enters itself (a dtype None turns one off)."""
    out: dict[str, Any] = {}
    if any_autocast_enabled():  # (one call where there is no autocast, the usual case)
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                out[dev] = str(torch.get_autocast_dtype(dev)).removeprefix("torch.")
    for dev, dtype in inner:
        if dtype is None:
            out.pop(dev, None)
        else:
            out[dev] = dtype
    return out
