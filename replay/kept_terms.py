"""Differentiable values of any shape the forward keeps on its modules (pykan's per-edge
``self.acts_scale``, read by its L1 + entropy regulariser), for a backward event the re-run of
``loss_fn`` does not make: a loss term the loop computes from them outside ``loss_fn``
backpropagates through the model, but the replay cannot re-run that code. Naming them, and
those all 0 or non-finite in the re-run (a normalisation by their sum is 0/0, a log of 0),
points at that term rather than at gradients the loop wrote by hand."""

from __future__ import annotations

import torch

from .transforms import outside_transforms

SHOWN = 4  # values named in the text (then "+N more")


def kept_values(runner) -> dict[str, torch.Tensor]:
    """``{module.attribute: value}`` of each tensor with an autograd graph that the re-run's
    forward left on a module's attributes (the last micro-batch's), detached."""
    found: dict[str, torch.Tensor] = {}
    modules = list(runner.model.named_modules())

    def hooks(model):
        def post(m, args, out):
            for name, mod in modules:
                for k, v in vars(mod).items():
                    if isinstance(v, torch.Tensor) and v.grad_fn is not None \
                            and v.is_floating_point():
                        found[f"{name}.{k}" if name else k] = v.detach().clone()
        return [model.register_forward_hook(outside_transforms(post))]

    try:
        runner.run(instrument=False, backward=False, hooks=hooks)
    except Exception:  # (what the re-run raises is reported elsewhere)
        return {}
    return found


def kept_terms_text(runner) -> str | None:
    """The hint for gradients a loss term over values the forward kept made; None when the
    forward keeps none."""
    kept = kept_values(runner)
    if not kept:
        return None
    names = list(kept)
    more = f" +{len(names) - SHOWN} more" if len(names) > SHOWN else ""
    zero = [n for n, v in kept.items() if v.numel() and not bool(v.any())]
    bad = [n for n, v in kept.items() if not bool(torch.isfinite(v).all())]
    said = (f"; in this step {', '.join(zero[:SHOWN])} {'is' if len(zero) == 1 else 'are'} 0 "
            "throughout (a share of its sum is 0/0 there, a log of it -inf; an entropy of "
            "those shares needs an eps in the sum and in the log, or to skip a layer whose "
            "sum is 0)" if zero else "")
    said += (f"; {', '.join(bad[:SHOWN])} already non-finite in the re-run" if bad else "")
    return ("the re-run of loss_fn and backward makes every gradient finite, but the "
            f"forward keeps differentiable values on its modules ({', '.join(names[:SHOWN])}"
            f"{more}): a loss term the loop computes from them outside loss_fn (a "
            "regulariser over activations: pykan's L1 + entropy of acts_scale) backpropagates "
            "through the model into these gradients, in code the replay cannot re-run" + said
            + "; compute that term inside loss_fn (given the model: loss_fn(out, y, model)) "
            "so that the recorder checks it and the replay re-runs it and names its op")
