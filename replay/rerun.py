"""Re-running the recorded step, deterministically, as often as the analysis needs.

Every run starts from the same state: RNG states from the bundle, buffers as recorded,
gradients cleared. A run is forward (each micro-batch), loss, backward; optional hooks watch it
(the instrumented pass: :mod:`replay.instrument`; the bisection's probes:
:mod:`replay.bisection`), and :meth:`Runner.float64` runs it in float64.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# Model outputs and losses are walked with the recorder's own tensor_leaves, not pytree: output j
# here must be the recorder's output j (recorded output gradients are keyed by it), and pytree
# leaves a dict or tuple subclass it does not know (a user's output type) unopened.
from recorder.capture import output_leaves, tensor_leaves
from recorder.finite import finite, matches, only_mask_infinities
from recorder.rng import RngCapture

from . import bisection
from .compat import non_persistent
from .direct_grads import backward_cut, cut_outputs, direct_params, stand_ins
from .errors import StopRun
from .external_grads import external as _external
from .float64 import widened
from .float64_run import cast as _cast
from .float64_run import default_dtype as _default_dtype
from .float64_run import loss_own as _loss_own
from .float64_run import to_float64 as _to_float64
from .frozen import FrozenParams
from .handled_loss import handled_by_loop
from .instrument import CallRecorder
from .kept_aside import kept_hooks, with_kept
from .kept_generators import own_generators, restore_generators
from .load import (
    Step,
    autocast_as_recorded,
    differentiates_model,
    loss_inputs,
    micro_batch_inputs,
    micro_batch_rng,
    output_grads,
    rng_state,
)
from .loopscale import loss_factor
from .loss_forward import forward_in_loss, loss_runs_model
from .loss_params import trained_loss_params
from .module_state import LossState, ModuleState
from .positive import keep_signs
from .precision import precision_hooks
from .raised_note import IN_BACKWARD
from .refit_in_forward import trained_copies, written_note, written_since
from .run_result import Run, dropped_non_finite
from .source import OP_ERROR, raised_by_model
from .train_mode import set_training
from .unfed_outputs import left_unfed, takes_unfed

__all__ = ["Runner", "StopRun"]


def restorable(model: nn.Module, name: str, saved: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether buffer ``name`` (``now``) is set back to ``saved`` before a re-run: not a
    non-persistent one that an earlier run replaced with another shape (a rotary cache the
    forward grew for a longer batch), as the model's plain attributes, which no reset
    restores, now describe the grown one."""
    return saved.shape == now.shape or not non_persistent(model, name)


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool | None):
    """The root's mode a micro-batch ran in (a validation forward in eval mode between the
    backward and ``optimizer.step()``), where it differs from the modes recorded at the step's
    end: every module switched, as ``model.eval()`` does, and put back after."""
    if training is None or training == model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    set_training(model, training)
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


class Runner:
    """Runs the step of a rebuilt bundle; see :meth:`run`."""

    def __init__(self, step: Step):
        self.step = step
        self.model: nn.Module = step.model
        patterns = step.meta.get("allow_inf", [])
        names = list(dict(self.model.named_modules()))
        self.allowed = {n for n in names if matches(n, patterns)}
        # bundles from before the default policy were recorded with every +-Inf an event
        self.strict_inf = bool(step.meta.get("strict_inf", True))
        # (by default a buffer's +-Inf leaves a call's inputs finite, as the recorder's does)
        self.allowed_buffers = {id(b) for n, b in self.model.named_buffers()
                                if not self.strict_inf or matches(n, patterns)}
        self.micro_batch = 0  # the micro-batch running (hooks read it)
        # the loss is running: a backward node's hook firing now runs in the loss's own
        # autograd.grad (a PINN's derivatives of the output), not in the step's backward
        self.in_loss = False
        self._initial_buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        # (a momentum encoder the forward updates; trained weights the step's code wrote)
        self._frozen = FrozenParams(self.model, frozenset(step.written))
        # the loss's state too (DINO's centre, which each call of the loss replaces)
        # (kept here: a run may wrap step.loss_fn in a function, the float64 one's op watch)
        self._loss_module = step.loss_fn if isinstance(step.loss_fn, nn.Module) else None
        self._loss_buffers = {n: b.detach().clone() for n, b in
                              (self._loss_module.named_buffers() if self._loss_module else ())}
        self._rng = rng_state(step)
        self.loss_state = LossState(step.loss_fn)  # (a plain loss's, and the objects it holds)
        self._state = ModuleState([*self.model.modules(), *self.loss_state.objects])
        self._generators = own_generators(self.model, self._loss_module)
        self.cast: torch.dtype | None = None  # run in this dtype (the float64 re-run)
        # gradients fed into the model outputs instead of the recorded ones, finite or not
        # (micro-batch -> output index -> gradient): see replay.outside
        self.out_grads: dict[int, dict[int, torch.Tensor]] | None = None
        # multiply the loss by this before backward, as the step's GradScaler did (only where
        # no finite recorded output gradient, which holds the scale already, is used)
        self.loss_scale: float | None = None
        # when a dict: the loop's factor on the loss (accumulation's 1/k) of each micro-batch
        # backpropagated from its recorded output gradients, by index (replay.loopscale)
        self.loss_factors: dict[int, list[float]] | None = None
        self.step_factors: list[float] = []  # (this runner's: one step's, replay.clip)
        self.last_loss = None
        self.loop_handled: dict | None = None  # (the first whole run's: replay.handled_loss)
        self.cut: list[torch.Tensor] | None = None  # stand-ins for outputs: replay.direct_grads
        # back-propagate the recorded output gradients even when non-finite: no loss to re-run
        # (computed in the loop), so they are what entered the model (a window's faithful run)
        self.feed_recorded = False
        # micro-batches whose recorded forward was non-finite (replay.outgrads): the non-finite
        # entries of their recorded output gradients came back through it, not from the loop
        self.nonfinite_forwards: set[int] = set()
        # add the differentiable values the forward kept on its modules to the backward's
        # roots (replay.kept_aside); ``kept``: those of the micro-batch running
        self.keep_aside = False
        self.kept: list[tuple[str, torch.Tensor]] = []
        # backward with create_graph=True, as the loop ran it (the bundle's ``grads_graph``):
        # an update that differentiates the gradients (SophiaH's Hessian-vector products)
        self.create_graph = False
        # (micro-batch, outputs) -> the outputs its loss takes (the float64 re-run's: the step's
        # own values where the loop derived loss arguments from them, replay.float64_loss_args)
        self.loss_outputs = None
        self.unfed: set[int] = set()  # (forwards a later loss backpropagates: unfed_outputs)

    # -- state reset -------------------------------------------------------------------------

    def run_twice(self, report) -> tuple[Run, Run]:
        """The step re-run twice from the same trained parameters: those the first run's
        forward wrote through ``.data`` are put back (and said in ``report``) before the
        second and every later run (:mod:`replay.refit_in_forward`)."""
        before = trained_copies(self.model)
        run1 = self.run()
        if written := written_since(self.model, before):
            self._frozen.keep(written)
            report["problems"].append(written_note(written, self.model))
        del before
        return run1, self.run()

    def frozen_written(self) -> list[str]:
        """The frozen parameters the last run's forward wrote (see FrozenParams.written)."""
        return self._frozen.written()

    def reset(self) -> None:
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                first = self._initial_buffers.get(n)
                if first is not None and restorable(self.model, n, first, b):
                    b.copy_(first)
        self._frozen.restore()
        self._state.restore()
        if self._loss_buffers:
            with torch.no_grad():
                for n, b in self._loss_module.named_buffers():
                    first = self._loss_buffers.get(n)
                    if first is not None and first.shape == b.shape:
                        b.copy_(first)
        self.model.zero_grad(set_to_none=True)
        self.unfed = set()
        if self._rng is not None:
            restore_generators(self._rng, self._generators)

    # -- one run -----------------------------------------------------------------------------

    def run(self, *, backward: bool = True, instrument: bool = True, hooks=None,
            forward_ctx=None, backward_ctx=None) -> Run:
        """Forward every micro-batch, the loss, and (``backward``) the backward pass.

        ``instrument`` records every module call (with syncs: this is the replay, not the
        recorder). ``hooks(model)`` may install extra hooks and must return their handles."""
        self.reset()
        result = Run(strict_inf=self.strict_inf, allowed=frozenset(self.allowed))
        handles = CallRecorder(self, result).install(self.model) if instrument else []
        if hooks is not None:
            handles += hooks(self.model)
        if self.keep_aside:
            handles += kept_hooks(self, self.model)
        if self.cast is None:  # FSDP2's MixedPrecisionPolicy, as recorded (not in float64)
            handles += precision_hooks(self.model, self.step.meta)
        try:
            with _default_dtype(self.cast):
                for i, mb in enumerate(self.step.micro_batches):
                    if mb.get("abandoned") and _abandoned(result):  # (recorder.abandoned)
                        continue
                    self.micro_batch = i
                    if mb.get("grads_dropped"):  # as the loop's zero_grad did before this one
                        result.dropped.setdefault(i, dropped_non_finite(self.model))
                        self.model.zero_grad(set_to_none=True)
                    args, kwargs = micro_batch_inputs(self.step, i, made := {})
                    began = self._loss_began(i)
                    if i and (rng := micro_batch_rng(self.step, i)) is not None:
                        restore_generators(rng, self._generators)  # the loop drew between forwards
                    if only_mask_infinities(tensor_leaves((args, kwargs))):
                        result.masked.add(i)
                    if self.cast is not None:
                        args, kwargs = _cast((args, kwargs), self.cast, made)
                    result.inputs.append(made)
                    with torch.set_grad_enabled(mb.get("grad_enabled", True)), \
                            (autocast_as_recorded(mb, self.step.device) if self.cast is None
                             else contextlib.nullcontext()), _enter(forward_ctx), \
                            _mode(self.model, mb.get("training")):
                        out = self.model(*args, **kwargs)
                    outs = list(output_leaves(out))  # (a Distribution's tensors too)
                    result.outputs.append(outs)
                    result.objects.append(out)
                    if began is not None:  # (the loss drew before its own forward)
                        restore_generators(began, self._generators)
                    self._loss_and_backward(i, outs, result, backward and mb.get(
                        "grad_enabled", True), forward_ctx, backward_ctx)
                if backward and self.loop_handled is None:  # (a whole run's: handled_loss)
                    self.loop_handled = result.handled
        except StopRun:
            pass
        except Exception as e:  # the model's code raising (an assert on NaN, an op refusing
            if not raised_by_model(e):  # NaN input) ends the run as it ended the step
                raise
            result.error = e
        finally:
            self._close(handles, result)
        if backward:
            result.bad_grads = [n for n, p in self.model.named_parameters()
                                if p.grad is not None and not finite(p.grad)]
        return result

    def _close(self, handles: list, result: Run) -> None:
        """A run's end: its hooks removed, and the RNG and the loss's own state put back as
        the loss call a re-run alone after it (the op finder's) computes began: the first
        micro-batch's whose loss was non-finite, else the last's (LossState.put_back)."""
        for h in handles:
            h.remove()
        rng = self.loss_state.put_back(result.loss_micro_batches, result.loss_finite)
        if rng is not None:
            restore_generators(rng, self._generators)

    def _loss_and_backward(self, i: int, outs, result: Run, backward: bool, forward_ctx,
                           backward_ctx) -> None:
        """Micro-batch ``i``'s loss (its nodes under ``forward_ctx`` too) and, when
        ``backward``, its backward; a raise the loop caught in training is passed over
        (replay.handled_loss)."""
        if backward:  # (the graph rules' verdicts on the outputs, before backward frees them)
            result.kept_signs += keep_signs(outs)
        loss = None
        with _enter(forward_ctx), handled_by_loop(self, i, result, "loss"):
            loss = self._loss(i, outs, result)
        if backward and i not in result.handled:
            with _enter(backward_ctx), handled_by_loop(self, i, result, "backward"):
                self._linalg_backward(i, outs, loss)

    def _loss_began(self, i: int) -> dict | None:
        """The RNG as micro-batch ``i`` begins, when its forward ran inside its own loss."""
        return RngCapture(list(self._generators.items()))() \
            if forward_in_loss(self.step, i) else None

    def _call_loss(self, args, kwargs):
        """What the loss raises (``BCELoss`` refusing a NaN input, as it did in training) is
        the step's code, not the replay's: it ends the re-run as it ended the step."""
        try:
            return self.step.loss_fn(*args, **kwargs)
        except Exception as e:
            setattr(e, OP_ERROR, True)
            raise

    def _loss(self, i: int, outs: list[torch.Tensor], result: Run):
        if self.step.loss_fn is None:
            return None
        outputs, self.cut = cut_outputs(self.step, i, result.outputs)  # (a loss given the model)
        if self.loss_outputs is not None:
            outputs = self.loss_outputs(i, outputs)
        li = loss_inputs(self.step, i, outputs, result.inputs[i], result.objects,
                         attached=self.unfed)
        if li is None:
            return None
        args, kwargs = li
        if not (data_ok := self._loss_data_finite(i)):  # (known before a loss that raises)
            result.bad_loss_data.add(i)
        self.in_loss = True
        self.loss_state.began(i, RngCapture(list(self._generators.items()))())
        try:
            if self.cast is not None:
                args, kwargs = _cast((args, kwargs), self.cast)
                loss = self._call_loss(args, kwargs)
            else:
                with autocast_as_recorded(self.step.micro_batches[i], self.step.device,
                                          loss=True):
                    loss = self._call_loss(args, kwargs)
        finally:
            self.in_loss = False
        self.last_loss = loss
        result.losses.append(loss)
        vals = [t for t in tensor_leaves(loss) if t.is_floating_point()]
        result.loss_micro_batches.append(i)
        result.loss_args_finite.append(data_ok)
        result.loss_finite.append(all(finite(t) for t in vals))
        result.loss_values.append(";".join(repr(t.detach().double().sum().item()) for t in vals))
        return loss

    def _loss_data_finite(self, i: int) -> bool:
        """Micro-batch ``i``'s recorded loss arguments (targets, not the model output) are
        finite."""
        return all(
            finite(t) for k in self.step.micro_batches[i].get("loss_paths", {})
            if isinstance(t := self.step.tensors.get(k), torch.Tensor) and t.is_floating_point())

    def _linalg_backward(self, i: int, outs, loss) -> None:
        """A derivative that fails in the step's graph (eigvals' backward at repeated
        eigenvalues, a nilpotent matrix's zeros) ends the re-run as it ended the step."""
        try:
            self._backward(i, outs, loss)
        except torch.linalg.LinAlgError as e:
            setattr(e, OP_ERROR, True)
            setattr(e, IN_BACKWARD, True)
            raise

    def _backward(self, i: int, outs, loss) -> None:
        fed = self.out_grads is not None
        grads = self.out_grads.get(i, {}) if fed else output_grads(self.step, i)
        pairs = [(o, grads[j]) for j, o in enumerate(outs) if j in grads and o.requires_grad]
        if differentiates_model(self.step, i) and not fed:
            pairs = []  # its loss reaches the weights through the output's derivative too
        if self.create_graph and isinstance(loss, torch.Tensor) and loss.requires_grad:
            pairs = []  # (recorded output gradients are constants: the loss's graph, not them)
        if pairs and loss_runs_model(self.step, i):
            pairs = []  # (the loss ran the model: its own backward covers this forward)
        if not fed and left_unfed(self.step, i, loss, grads):
            self.unfed.add(i)  # (its graph waits for the later loss's backward)
        if pairs and not fed and takes_unfed(self.step, i, self.unfed):
            pairs = []  # (the loss's backward reaches those forwards: no recorded gradient)
        if pairs and (fed or self.feed_recorded or all(finite(g) for _, g in pairs)):
            # The recorded gradient of the model output is exact whatever the loop did to the
            # loss (scaling, division for accumulation); prefer it.
            pairs = _external(pairs, i in self.nonfinite_forwards)
            own = [*trained_loss_params(self.step), *direct_params(self.model, self.cut)] \
                if isinstance(loss, torch.Tensor) and loss.requires_grad else []
            k = loss_factor(loss, stand_ins(pairs, outs, self.cut), self.loss_scale) \
                if self.loss_factors is not None or own else None
            if self.loss_factors is not None and k is not None:
                self.loss_factors.setdefault(i, []).append(k)
                self.step_factors.append(k)
            if own:  # the loss's trained parameters (a temperature) are past the outputs: their
                # gradients come from the loss, times what the loop and the GradScaler put on it
                f = (k or self.step.micro_batches[i].get("loss_factor") or 1.0) \
                    * (self.loss_scale or 1.0)
                # (kept: its direct path may share the forward's nodes, a regulariser over
                # activations the forward kept on a module, which the output's path needs next)
                (loss * f).backward(inputs=own, retain_graph=True, create_graph=self.create_graph)
            torch.autograd.backward(*with_kept(self, [o for o, _ in pairs],
                                               [g.to(o.dtype) for o, g in pairs]),
                                    create_graph=self.create_graph)
        elif (loss := scalar_loss(loss)) is not None:
            # (a loss of several values, reduction="none", was reduced by the loop outside the
            # recorder, in a way the replay does not know: no backward from it; a what-if's
            # micro-batch carries the loop's own factor: replay.loopscale)
            k = self.step.micro_batches[i].get("loss_factor")
            root = loss * (self.loss_scale or 1.0) * (k or 1.0) if self.loss_scale or k else loss
            if self.cut is not None:
                return backward_cut(self, root, outs, self.cut, with_kept)
            torch.autograd.backward(*with_kept(self, [root], [torch.ones_like(loss)]),
                                    create_graph=self.create_graph)
        elif self.keep_aside and self.kept:
            torch.autograd.backward(*with_kept(self, [], []), create_graph=self.create_graph)

    # -- float64 -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def float64(self):
        """Run in float64 inside the block (weights, buffers and the recorded buffer values a
        run starts from, the loss's parameters and buffers: a perceptual loss's frozen feature
        extractor); every dtype is restored after."""
        model, loss = self.model, self.step.loss_fn
        dtypes = _to_float64(list(model.named_parameters()) + list(model.named_buffers()))
        # (the loss's trained parameters, and the modules it shares with the model, are the
        # model's, widened and restored as the model's: not counted twice)
        loss_params = _to_float64(_loss_own(loss, model, "named_parameters"))
        loss_dtypes = _to_float64(_loss_own(loss, model, "named_buffers"), even_float64=True)
        saved = self._initial_buffers
        self._initial_buffers = {n: b.to(widened(b.dtype) or b.dtype) for n, b in saved.items()}
        self.cast = torch.float64
        try:
            with self._frozen.widened():
                yield
        finally:
            self.cast = None
            self._initial_buffers = saved
            with torch.no_grad():
                for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                    if name in dtypes:
                        t.data = t.data.to(dtypes[name])
                        if t.grad is not None:
                            t.grad = None
                for name, t in _loss_own(loss, model, "named_parameters"):
                    if name in loss_params:
                        t.data = t.data.to(loss_params[name])
                for name, t in _loss_own(loss, model, "named_buffers"):
                    if name in loss_dtypes:
                        t.data = t.data.to(loss_dtypes[name])

    # -- bisection (replay.bisection) ----------------------------------------------------------

    def probe(self, k: int, allowed: set[str]) -> bool:
        """Has any call up to completion index ``k`` made a non-finite output? (one read)"""
        return bisection.probe(self, k, allowed)

    def probe_origin(self, k: int, nan_only: bool = False) -> tuple[str, int, int] | None:
        """``(module, call, micro-batch)`` that made the first non-finite output, at ``k``."""
        return bisection.probe_origin(self, k, nan_only)

    def bisect(self, n_calls: int, nan_only: bool = False) -> tuple[int | None, int]:
        """Smallest completion index whose prefix holds a non-finite output (a NaN, with
        ``nan_only``), and the number of probes used (ceil(log2(n)) at most). The caller knows
        some output is non-finite."""
        allowed = set(dict(self.model.named_modules())) if nan_only else self.allowed
        return bisection.search(lambda k: self.probe(k, allowed), n_calls)


def scalar_loss(loss) -> torch.Tensor | None:
    """The loss to differentiate: a scalar that requires grad, or the one such scalar of a
    loss_fn returning ``(total, {"mel": mel_loss.detach(), ...})``, the terms to log, or the
    sum of a dict of terms (see :func:`_dict_total`)."""
    if isinstance(loss, torch.Tensor):
        return loss if loss.requires_grad and loss.numel() == 1 else None
    found = [t for t in tensor_leaves(loss) if t.requires_grad and t.numel() == 1]
    if len(found) > 1 and isinstance(loss, dict):
        return _dict_total(loss)
    return found[0] if len(found) == 1 else None


def _dict_total(loss: dict) -> torch.Tensor | None:
    """A loss_fn returning a dict of terms (mmflow's and mmdet's ``{"loss_flow": ...}``,
    detectron2's ``loss_dict``), which the loop sums: the terms named ``loss...`` where any
    is (mmcv's ``parse_losses``: the others are logged), else every term; a term that is a
    list of values (one per level) counted by its values' means, as mmcv does. A scalar
    named exactly ``loss`` is the total the loop backpropagates beside the terms it logs
    (CompressAI's ``{"bpp_loss", "mse_loss", "loss"}``, Lightning's and HF's ``loss``): it
    alone, or the re-run trains on the terms twice."""
    terms = {k: [t for t in tensor_leaves(v) if t.requires_grad] for k, v in loss.items()}
    terms = {k: ts for k, ts in terms.items() if ts}
    if len(total := terms.get("loss", [])) == 1 and total[0].numel() == 1:
        return total[0]
    named = [ts for k, ts in terms.items() if "loss" in str(k)]
    picked = [t.mean() for ts in (named or list(terms.values())) for t in ts]
    return sum(picked[1:], picked[0]) if picked else None


def _enter(ctx):
    """A fresh context from the ``ctx`` factory, or none."""
    return ctx() if ctx is not None else contextlib.nullcontext()


def _abandoned(result: Run) -> bool:
    """Empty places for a micro-batch whose forward raised and which the loop skipped: no
    part of the step's update, so not run again (its forward would raise again, on the refused
    batch's NaN, before the micro-batch the event is in). True."""
    result.inputs.append({})
    result.outputs.append([])
    result.objects.append(None)
    return True
