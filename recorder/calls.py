"""The hooks that write each module call's statistics into the open step's tape.

Only the root needs a pre-hook (it opens steps, see :mod:`recorder.cycle`); every call is
recorded when it returns, with its inputs' statistics looked up from the calls that produced
them, so a chain of modules costs one reduction per call. Every hook is a no-op while the
recorder is inactive, and never lets an error of its own reach training (see
:class:`~recorder.hooks.Health`).
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn

from .capture import as_called, data_arguments, output_leaves
from .compat import (
    at_backward_end,
    forward_hooks,
    func_transform,
    global_forward_hooks,
    in_backward,
    version,
    version_of,
)
from .compiled import disabled
from .cycle import StepCycle
from .errors import NonFiniteError
from .finite import checkable, stored
from .hand_steps import awaits_backward, step_end_hooks
from .hooks import Health, Hook
from .out_grads import keep_grad, keep_out_grad
from .pipeline_stage import in_shape_inference
from .refs import (
    input_refs,
    leaves,
    mask_positions,
    output_ref,
    output_refs,
    produced,
    root_input_refs,
)
from .shards import local
from .slots import FLOAT32, GRAD, LOOSE, NAN_ONLY, STRICT
from .tape import MicroBatch, Tape
from .target import Target, autocast_state


class CallHooks:
    """Module, loss and gradient hooks of one recorder (see the module docstring)."""

    def __init__(self, target: Target, cycle: StepCycle, health: Health, loss_fn, param_norms):
        self.target, self.cycle, self.health, self.loss_fn = target, cycle, health, loss_fn
        self.param_norms = param_norms  # stats="full": means, RMS and weight norms too
        self.strict_inf = target.settings.strict_inf
        self.loss_recorded = False  # record_loss has been given a loss (no loss_fn to replay)
        self.copy_inputs = False  # the model's forward writes into its floating inputs
        self.shape_pass = False  # the root runs on meta tensors; the recorder paused
        self.mask_at: dict[int, tuple[int, ...]] = {}  # site -> its forward's mask positions
        self.loss_seen = False  # the loss module's hook ran (see recorder.unwatched_loss)

    def register(self) -> list:
        """Hook every site of the bound target (and the loss module, and the gradients of the
        large parameters where backward hooks take their norms); returns the handles."""
        target = self.target
        sites = target.sites
        root = sites[0]
        self.inner_hooked = False  # a module under the root has a hook (see _end_micro_batch)
        # (the root's and the loss's hooks run eagerly where dynamo traces the call, a compiled
        # region's own or a compiled training step's, see recorder.compiled; the modules inside
        # a region are not hooked)
        handles = [root.target.register_forward_pre_hook(Hook(disabled(self.root_pre_hook)),
                                                         with_kwargs=True)]
        for idx, site in enumerate(sites):
            if site.target is None or site.name in target.passing:
                continue
            if not idx or self.param_norms:  # (stats="full": means and spreads too)
                fn = self.post_hook
            elif type(site.module) is nn.ReLU and not rewritten_output(site.module):
                fn = self.relu_hook
            else:  # (a container's output is usually an inner call's, passed through)
                fn = self.leaf_hook if next(site.module.children(), None) is None \
                    else self.post_hook
            # allowed: its outputs are checked for NaN only; intended: an ``allow_inf`` module,
            # whose +-Inf leave a later call's inputs finite (by default every module but the
            # root is checked for NaN only, yet the +-Inf it returns are no finite input)
            allowed = target.inf_allowed(idx, site.name)
            intended = target.is_allowed(site.name)
            self.mask_at[idx] = mask_positions(site.module) if idx else ()
            hook = (Hook(disabled(partial(fn, idx, allowed, intended))) if site.disable or not idx
                    else Hook(fn, idx, allowed, intended))
            handles.append(site.target.register_forward_hook(hook, with_kwargs=True))
            self.inner_hooked = self.inner_hooked or bool(idx)
        if self.loss_fn is not None:
            handles.append(self.loss_fn.register_forward_hook(
                Hook(disabled(self.loss_post_hook)), with_kwargs=True, always_call=True))
        if target.grad_hooks:
            for i, p in target.large:
                if not p.requires_grad:  # (frozen, held by the optimizer: read before its step)
                    continue
                handles.append(p.register_post_accumulate_grad_hook(Hook(self.grad_hook, i)))
        if not target.has_optimizer:  # (the loop's own update: see recorder.hand_steps)
            handles += step_end_hooks(target, self.cycle, self.health, self.backward_wrote)
        return handles

    # ------------------------------------------------------------------------------------------
    # the root: a micro-batch begins

    def root_pre_hook(self, module, args, kwargs):
        if not self.health.active:
            if not self.shape_pass or _on_meta(args, kwargs):
                return None
            self.shape_pass, self.health.active = False, True  # (after a shape pass that raised)
        if func_transform() is not None:  # see _outside
            self.cycle.transformed = True
            return None
        if _on_meta(args, kwargs) or in_shape_inference():
            # a pass with no data (Keras's symbolic build, a shape inference on the meta device
            # or on a pipeline stage's empty buffers): no step, and nothing to measure, until
            # the root returns (see _outside)
            self.shape_pass, self.health.active = True, False
            return None
        try:
            root = self.target.model()  # (``module`` may be a compile wrapper, whose mode can lag)
            self._begin_micro_batch(args, kwargs, (module if root is None else root).training,
                                    root)
        except NonFiniteError:
            raise
        except Exception as e:  # never let the recorder's own bug stop training
            self.health.internal_error(e)
        return None

    def _begin_micro_batch(self, args, kwargs, training: bool, root=None) -> None:
        cycle = self.cycle
        cycle.eval_tail = None  # an evaluation forward whose loss never came
        with cycle.lock:
            # gradients off: an evaluation, in train mode too (a validation loop without
            # model.eval(), RL rollouts, swa_utils.update_bn), unless an input requires grad
            # (a root run under a reentrant checkpoint, whose backward runs it again)
            tape = cycle.tape_for_forward(not torch.is_grad_enabled() and not (
                training and any(t.requires_grad for t in leaves(args, kwargs))))
            mb = MicroBatch(*as_called(args, kwargs), grad_enabled=torch.is_grad_enabled(),
                            training=training,
                            autocast=autocast_state(self.target.root_autocast(root)))
            if tape.micro_batches and not self.copy_inputs \
                    and tape.micro_batches[-1].written_since(leaves(args, kwargs)):
                # the loop wrote into the last micro-batch's inputs since (one buffer reused for
                # every micro-batch, static_x.copy_(x)), or may have: keep copies from here on
                self.copy_inputs = True
            if tape.micro_batches and tape.micro_batches[-1].targets_moved():
                cycle.copy_targets = True  # (likewise for the loss's targets: sy.copy_(y))
            if self.copy_inputs:  # a forward that writes into its inputs: keep them as they came
                args, kwargs = mb.keep_copies(args, kwargs)  # (measured in their place)
            mb.input_refs = root_input_refs(tape, self.target, self.strict_inf, args, kwargs,
                                            [] if self.copy_inputs else mb.input_versions)
            # (a forward run inside backward, a checkpointed model's recomputation, comes before
            # that backward wrote any gradient: no zero_grad dropped them)
            if tape.micro_batches and training and not self.target.sharded \
                    and not in_backward():
                mb.grads_dropped = _grads_dropped(tape.micro_batches, self.target.params)
            if tape.micro_batches and not tape.evaluation:  # (the first has the step's)
                mb.rng = cycle.capture_rng()
            tape.add_micro_batch(mb, self.target.watched)

    def _end_micro_batch(self, tape: Tape, output) -> None:
        """Keep the root output, and the gradient backward brings to each of its tensors."""
        mb = tape.micro_batches[tape.micro_batch]
        mb.outputs = output
        # its calls ran in a compiled caller's graph, which traced their hooks: one region
        if self.cycle.traced or (self.inner_hooked and not _inner_recorded(tape)):
            self.cycle.traced = False
            self.target.compiled.add("")
        if not self.copy_inputs and mb.inputs_moved():
            # the forward wrote into its input (wav.div_(peak)): this micro-batch's is kept as
            # the forward left it, the next ones' are copied when they come in
            self.copy_inputs = mb.inputs_written = True
        if torch.is_grad_enabled():
            # (kept by the micro-batch, and its norm taken when the step closes: see
            # recorder.grads; the hooks hold that dict, never the tape)
            for i, t in enumerate((output,) if type(output) is torch.Tensor
                                  else output_leaves(output)):
                fn = t.grad_fn
                if fn is not None:  # a pre-hook on its node: a tenth of register_hook's Python
                    fn.register_prehook(partial(keep_out_grad, mb.out_grads, mb.differentiated,
                                                i, t.output_nr))
                elif t.requires_grad:
                    t.register_hook(partial(keep_grad, mb.out_grads, mb.differentiated, i))

    # ------------------------------------------------------------------------------------------
    # every module: a call returned

    def post_hook(self, idx: int, allowed: bool, intended: bool, module, args, kwargs, output):
        tape = self.cycle.tape
        if tape is None or not self.health.active or func_transform() is not None:
            return self._outside(idx, tape)
        try:
            mb = tape.micro_batch
            if idx == 0:
                ins = tape.micro_batches[mb].input_refs
            elif len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor and \
                    (hit := produced(tape, args[0], output)) is not None:
                ins = (hit[1:4],)  # one tensor in, an earlier call's output: the usual chain
            else:
                ins = input_refs(tape, self.target, args, kwargs, made_here=output,
                                 mask_at=self.mask_at.get(idx, ()))
            if type(output) is torch.Tensor and not self.param_norms:  # the usual case
                outs, stats = output_ref(tape, output, allowed, intended, reuse=True), None
            else:
                outs, stats = output_refs(tape, output, allowed, intended, self.param_norms)
            tape.calls.append((idx, mb, len(tape.calls), outs, stats, ins))
            if idx == 0:
                self._end_micro_batch(tape, output)
        except Exception as e:
            self.health.internal_error(e)
        if idx == 0 and tape.evaluation and self.health.active:  # checked now, its batch let go
            self.cycle.close_tape(at="evaluation")
            if self.loss_fn is not None:  # ...once its loss is checked too (or none comes)
                self.cycle.eval_tail = tape
        return None

    def leaf_hook(self, idx: int, allowed: bool, intended: bool, module, args, kwargs, output):
        """A leaf module's call: :meth:`post_hook`, with its usual case (one tensor in that an
        earlier call produced, one new non-empty float32 tensor out) taken in one frame, as it
        runs for most calls of most models (a Linear, a convolution, a norm)."""
        tape = self.cycle.tape
        if tape is None or not self.health.active or func_transform() is not None:
            return self._outside(idx, tape)
        if len(args) != 1 or kwargs or type(output) is not torch.Tensor \
                or output.dtype is not FLOAT32:
            return self.post_hook(idx, allowed, intended, module, args, kwargs, output)
        try:
            a, cache = args[0], tape.cache
            hit = cache.get(id(a))
            if hit is None or hit[0]() is not a or a is output or hit[4] is None \
                    or hit[4] != version(a) or not output.numel():
                return self.post_hook(idx, allowed, intended, module, args, kwargs, output)
            lo, hi = tape.slots.minmax(output.detach(), NAN_ONLY if allowed else STRICT)
            cache[id(output)] = (weakref.ref(output), lo, hi, intended, version_of(output))
            calls = tape.calls  # (micro-batch: ``Tape.micro_batch`` inlined, its usual case)
            calls.append((idx, tape.last if tape.by_thread is None else tape.micro_batch,
                          len(calls), ((lo, hi),), None, (hit[1:4],)))
        except Exception as e:
            self.health.internal_error(e)
        return None

    def relu_hook(self, idx: int, allowed: bool, intended: bool, module, args, kwargs, output):
        """An ``nn.ReLU`` call: its output's min and max are the ReLU of its input's (ReLU is
        elementwise and non-decreasing; NaN stays NaN, -Inf becomes 0, +Inf stays), so they are
        derived from the input's statistics with one op on two numbers instead of a pass over
        the output. The input's come from the call that produced it, else from one
        ``aminmax``."""
        tape = self.cycle.tape
        if tape is None or not self.health.active or func_transform() is not None:
            return self._outside(idx, tape)
        if len(args) != 1 or kwargs or type(args[0]) is not torch.Tensor \
                or type(output) is not torch.Tensor or output.dtype is not FLOAT32 \
                or args[0].dtype is not FLOAT32:
            return self.post_hook(idx, allowed, intended, module, args, kwargs, output)
        try:
            a, slots, cache = args[0], tape.slots, tape.cache
            hit = cache.get(id(a))  # (``_produced`` inlined, its usual case)
            if hit is None or hit[0]() is not a or (a is not output and (
                    hit[4] is None or hit[4] != version(a))):
                hit = produced(tape, a, output)
            if hit is not None:
                ins = (hit[1:4],)
                lo, hi = hit[1], hit[2]
            else:  # (where the ReLU is checked for NaN only, so is its input in its place:
                # a NaN passes a ReLU, so the ReLU's statistics are derived from these)
                lo, hi = slots.minmax(a.detach(), NAN_ONLY if allowed else LOOSE)
                ins = ((lo, hi, False),)
            ra, rb = slots.relu(lo, hi, NAN_ONLY if allowed else STRICT)
            cache[id(output)] = (weakref.ref(output), ra, rb, intended, version_of(output))
            tape.calls.append((idx, tape.last if tape.by_thread is None else tape.micro_batch,
                               len(tape.calls), ((ra, rb),), None, ins))  # (see leaf_hook)
        except Exception as e:
            self.health.internal_error(e)
        return None

    def _outside(self, idx: int, tape: Tape | None) -> None:
        """A call with nothing to record: inactive, no step open, or run under a torch.func
        transform (``vmap(grad(...))`` of a ``functional_call``: per-sample gradients, an
        ensemble), whose wrapped tensors are no part of the step and no reduction into a slot
        takes. Traced by dynamo (the model called from a compiled training step, whose
        root hooks run eagerly), the call is part of the root's compiled region: said by the
        root's post-hook, which finds no inner call (:func:`_inner_recorded`), or, with no step
        open (a compiled ``model.forward`` skips the root's hooks), by the flag written here,
        which dynamo replays at each run of its graph. (Not with a step open: inside a
        torch.cond branch or a while_loop body, a side effect dynamo refuses, failing it.)"""
        if not idx and self.shape_pass:  # (the root returned from its shape pass)
            self.shape_pass, self.health.active = False, True
        elif torch.compiler.is_compiling():
            if tape is None:
                self.cycle.traced = True
        elif func_transform() is None:
            self.cycle.outside_step(idx, tape)

    # ------------------------------------------------------------------------------------------
    # the loss and the gradients

    def loss_post_hook(self, module, args, kwargs, output):
        if in_shape_inference():  # (the last pipeline stage's loss of its empty buffers)
            return None
        self.loss_seen, cycle = True, self.cycle
        tape = cycle.tape
        if func_transform() is not None:  # (see _outside)
            return None
        if tape is None and cycle.eval_tail is not None and self.health.active:
            if output is None:  # (it raised: its check could only raise inside torch's handler)
                return None
            tape, cycle.eval_tail = cycle.eval_tail, None
            try:
                self.record_loss_call(tape, args, kwargs, output)
            except Exception as e:
                self.health.internal_error(e)
                return None
            cycle.check_evaluation_loss(tape)
            return None
        if not self.health.active or tape is None or not tape.micro_batches:
            return None
        try:
            self.record_loss_call(tape, args, kwargs, output)
        except Exception as e:
            self.health.internal_error(e)
        return None

    def record_loss_call(self, tape: Tape, args, kwargs, output) -> None:
        """The loss call's arguments (the targets, kept by reference) on the micro-batch, and
        the (min, max) of each floating output among the step's must-be-finite statistics."""
        mb = tape.micro_batches[tape.micro_batch]
        if output is None:  # it raised (always_call: validate_args refusing a NaN target)
            output = data_arguments((args, kwargs), mb.outputs)  # (checked in its place)
        mb.keep_loss_call(args, kwargs, tape.cache, self.cycle.copy_targets,  # (autocast_state:
                          first=len(tape.loss), autocast=autocast_state([]))  # no device read)
        tape.loss_stats(output)

    def grad_hook(self, i: int, p: torch.Tensor) -> None:
        """Squared norms of a gradient (and, with ``stats="full"``, its parameter) when backward
        has written it: used where the optimizer's pre-hook may not run before the gradient is
        gone (no optimizer; a GradScaler that skips the update), see ``Target``."""
        tape = self.cycle.tape
        if not self.health.active or tape is None or p.grad is None or not checkable(p.grad) \
                or func_transform() is not None:
            return
        try:
            grad = stored(p.grad)  # (a sparse one: its values)
            g = tape.slots.sq_norm(local(grad).detach(), GRAD)  # (FSDP2: the local shard)
            w = tape.slots.sq_norm(local(p).detach(), STRICT) if self.param_norms else None
            with tape.lock:  # accumulation: the last call sees the accumulated gradient
                tape.grad_norms[i] = g
                if w is not None:
                    tape.param_norms[i] = w
                tape.grad_seen[i] = (id(grad), version(grad))
        except Exception as e:
            self.health.internal_error(e)
        if not tape.close_queued and not self.target.has_optimizer:
            self.backward_wrote(p)

    def backward_wrote(self, p: torch.Tensor) -> None:
        """No optimizer: a backward wrote a gradient while a training step is open (its
        forward returned). The step closes when that backward ends (the autograd engine's
        final callback), before the loop's own update (``p.data.add_(p.grad, alpha=-lr)``,
        an optimizer not given to the recorder) writes the weights the forward read: the
        bundle holds them as the step ran, its gradients included."""
        tape = self.cycle.tape
        if tape is None or tape.close_queued or not self.health.active \
                or not awaits_backward(tape):
            return  # (a backward inside the forward: not this step's)
        tape.close_queued = True
        try:
            at_backward_end(partial(self.cycle.closed_by_backward, tape))
        except Exception as e:  # (outside a backward: a hook called by hand)
            tape.close_queued = False
            self.health.internal_error(e)


# ----------------------------------------------------------------------------------------------
# helpers


def _grads_dropped(earlier: list[MicroBatch], params) -> bool:
    """A backward ran through a micro-batch since the last drop (its output's gradient
    came), and yet no parameter holds a gradient: the loop's ``zero_grad`` dropped them, so
    they are no part of the update. (Accumulation stops at the first gradient found.)"""
    since = next((i for i in range(len(earlier) - 1, -1, -1)
                  if earlier[i].grads_dropped), 0)
    return any(m.out_grads for m in earlier[since:]) and \
        all(p.grad is None for _, p in params)


def _inner_recorded(tape: Tape) -> bool:
    """Whether a call under the root was recorded in the micro-batch the root's own call, the
    last entry, closes (found among the entries before it; another thread's may interleave)."""
    calls, mb = tape.calls, tape.calls[-1][1]
    for k in range(len(calls) - 2, -1, -1):
        c = calls[k]
        if c[1] == mb:
            if c[0]:
                return True
        elif tape.by_thread is None:  # (an earlier micro-batch's: none of this one before)
            return False
    return False


def _on_meta(args, kwargs) -> bool:
    """The root's inputs are meta tensors (shapes without data)."""
    a = args[0] if args else None
    if type(a) is torch.Tensor:
        return a.is_meta
    return any(t.is_meta for t in leaves(args, kwargs))


def rewritten_output(module: nn.Module) -> bool:
    """A forward hook registered before the recorder's (the module's own, or a global one)
    may return another output (a pruning mask, fake quantization, activation patching), so the
    output's statistics are not those derived from the input's (see ``relu_hook``)."""
    return global_forward_hooks() or any(kind == "forward" for kind, _ in forward_hooks(module))
