"""The arguments a loss is re-run with (the model outputs detached, what the op finder needs to
know of them) and the samples whose own loss is non-finite."""

from __future__ import annotations

import torch

from recorder.capture import tensor_leaves

from .load import Step, autocast_dtype, differentiates_model, loss_inputs
from .moved import Moved
from .ops import OpFinder
from .recorded import samples
from .run_result import Run


def loss_args(step: Step, run: Run, mb: int, finder: OpFinder | None = None,
              moved: Moved | None = None):
    """The loss's arguments, the model outputs detached; ``finder`` is told which of those
    the model made by exp, softmax, sigmoid or softplus, or by tanh or sigmoid (their graph is
    cut here), so that a 0 the loss takes the log of (a softplus variance) reads as the
    underflow it is, and a 0 of 1 - h (a sigmoid hazard rounded to 1) as rounding; its
    lineage, which outputs were on the autograd graph and which arguments are per sample (a
    list of per-image target dicts); ``moved``: where the forward put the outputs' samples
    (:mod:`replay.output_places`), handed to ``finder``."""
    if differentiates_model(step, mb):  # (the loss differentiates them: not cut)
        return loss_inputs(step, mb, run.outputs, run.inputs[mb], run.objects)
    outputs = [[t.detach() for t in o] for o in run.outputs]
    if finder is not None:
        for made, cut in zip(run.outputs, outputs):
            for t, d in zip(made, cut):
                finder.mark_made_by(t.grad_fn, d)
                if moved is not None and (place := moved.place(t)) is not None:
                    finder.moved.follow(d, place)
    derived: list = []  # (a cast of an output: out.float() of a bfloat16 autocast forward)
    args, kwargs = loss_inputs(step, mb, outputs, objects=run.objects, made=derived)
    if finder is not None and (cast := autocast_dtype(step.micro_batches[mb])) is not None:
        # (the outputs were computed under the forward's autocast: a float16 conv's flush to
        # 0 that a float32 output carried is an underflow the float64 re-run tells apart)
        finder.given_in = cast
    if finder is not None and finder.lineage is not None:
        trained = [d for made, cut in zip(run.outputs, outputs) for t, d in zip(made, cut)
                   if t.requires_grad]
        trained += [arg for o, arg in derived if any(o is d for d in trained)]
        made_from = {id(d): t for made, cut in zip(run.outputs, outputs)
                     for t, d in zip(made, cut)}
        for o, arg in derived:  # (a softplus output the loop cast: still softplus's)
            if id(o) in made_from:
                finder.mark_made_by(made_from[id(o)].grad_fn, arg)
        trained += graph_args(step, mb, args, kwargs)
        finder.lineage.seed_learned([*trained, *step.loss_fn.parameters()]
                                    if isinstance(step.loss_fn, torch.nn.Module) else trained)
        finder.lineage.seed_samples(args, kwargs, skip=[d for o in outputs for d in o]
                                    + [arg for _, arg in derived], batched=True)
    return args, kwargs


def graph_args(step: Step, mb: int, args, kwargs) -> list[torch.Tensor]:
    """The loss's arguments that had an autograd graph as the loss took them and are no model
    output (``loss_grad_args``: made from the outputs by code the bundle does not hold, a GAN
    discriminator the recorder was not given, run on the recorded generator's fakes): values
    something learned, not data, though the replay holds them as values."""
    held = [t for k in step.micro_batches[mb].get("loss_grad_args") or ()
            if isinstance(t := step.tensors.get(k), torch.Tensor)]
    return [t for t in tensor_leaves((args, kwargs)) if any(
        t is h or (t.shape == h.shape and t.dtype == h.dtype
                   and torch.equal(t, h.to(t.device))) for h in held)] if held else []


def loss_samples(step: Step, run: Run, mb: int) -> list[int]:
    """Rows whose own loss is non-finite (the loss re-run with reduction='none')."""
    fn = step.loss_fn
    if not hasattr(fn, "reduction"):
        return []
    args, kwargs = loss_args(step, run, mb)
    saved = fn.reduction
    try:
        fn.reduction = "none"
        with torch.no_grad():
            per = fn(*args, **kwargs)
        return samples(step, mb).rows(per) if isinstance(per, torch.Tensor) and per.dim() else []
    except Exception:
        return []
    finally:
        fn.reduction = saved
