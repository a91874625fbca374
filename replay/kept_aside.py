"""Differentiable values the forward keeps aside on its modules (a Bayes-by-backprop layer's
``self.log_prior``, a VAE encoder's ``self.kl``), which the loop adds to the loss outside
``loss_fn`` (``loss = criterion(out, y) + model.kl() / n``). The re-run differentiates
``loss_fn`` only; with ``Runner.keep_aside`` it adds these values to the backward's roots too
(each weighted 1: the loop's weights are not recorded). See :mod:`replay.kept_report`.
"""

from __future__ import annotations

import torch

from .transforms import outside_transforms


def kept_hooks(runner, model: torch.nn.Module) -> list:
    """Hooks that put into ``runner.kept`` each ``(module name.attribute, tensor)`` that a
    root forward assigned to a module's attribute and that carries a graph: a single value,
    as a loss term is (not an activation kept for plotting, an attention map, which the
    loop does not add to the loss)."""
    modules = list(model.named_modules())
    before: dict[tuple[int, str], int] = {}

    def attrs():
        for name, m in modules:
            for k, v in vars(m).items():
                if isinstance(v, torch.Tensor) and v.grad_fn is not None \
                        and v.is_floating_point() and v.numel() == 1:
                    yield name, m, k, v

    def pre(m, args):
        before.clear()
        before.update({(id(mod), k): id(v) for _, mod, k, v in attrs()})
        runner.kept = []

    def post(m, args, out):
        runner.kept = [(f"{n}.{k}" if n else k, v) for n, mod, k, v in attrs()
                       if before.get((id(mod), k)) != id(v)]

    return [model.register_forward_pre_hook(outside_transforms(pre)),
            model.register_forward_hook(outside_transforms(post))]


def with_kept(runner, roots: list, grads: list) -> tuple[list, list]:
    """The backward's roots and their gradients, with the values kept aside (weighted 1)."""
    kept = [t for _, t in runner.kept] if runner.keep_aside else []
    return roots + kept, grads + [torch.ones_like(t) for t in kept]
