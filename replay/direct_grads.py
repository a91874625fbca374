"""A loss given the model itself (FedProx's or EWC's ``loss_fn(out, y, model)``, comparing its
parameters with a copy of the global or the old weights): its value reaches the parameters by
two paths, through the model's output and directly. The re-run backpropagates the output's
path from the recorded output gradient (exact whatever the loop did to the loss), which left
the direct one out: a NaN that only the term on the weights made (a hand-written
``sqrt(sum((w - w_g) ** 2))`` at ``w == w_g``, every round's first local step) did not come
back. The loss is given stand-ins for the outputs, cut from the model's graph, so that its own
backward reaches the parameters by the direct path alone, and the output's path is
backpropagated as before."""

from __future__ import annotations

import torch
from torch import nn

from recorder.capture import tree_refs

from .load import Step, differentiates_model
from .loss_params import trained_loss_params


def cut_outputs(step: Step, i: int, outputs: list[list[torch.Tensor]]
                ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor] | None]:
    """``outputs`` with micro-batch ``i``'s swapped for stand-ins cut from the model's graph
    (each requiring grad as its output does), and the stand-ins; ``outputs`` and None when
    that micro-batch's loss was not given the model, one of its modules or parameters."""
    entry = step.micro_batches[i]
    tree = entry.get("loss_inputs")
    if len(outputs) <= i or differentiates_model(step, i) or not (any(
            isinstance(m, str) for key in ("$module", "$param") for m in tree_refs(tree, key))
            or holds_trained(step)):
        return outputs, None
    cut = [o.detach().requires_grad_(o.requires_grad) for o in outputs[i]]
    return [*outputs[:i], cut, *outputs[i + 1:]], cut


def holds_trained(step: Step) -> bool:
    """Whether the rebuilt loss holds one of the model's trained parameters as its own (a
    loss given the model at construction, ``Loss(model)``, reading a learned jitter or
    temperature of it in ``forward``): a direct path the outputs' gradient leaves out too."""
    loss, model = step.loss_fn, step.model
    if not isinstance(loss, nn.Module) or model is None:
        return False
    ids = {id(p) for p in model.parameters() if p.requires_grad}
    return any(id(p) in ids for p in loss.parameters())


def direct_params(model: nn.Module, cut: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The model's parameters a loss given stand-ins (``cut``) reaches directly."""
    return [] if cut is None else [p for p in model.parameters() if p.requires_grad]


def stand_ins(pairs, outs: list[torch.Tensor], cut: list[torch.Tensor] | None):
    """``(output, gradient)`` pairs with each output swapped for the stand-in the loss took."""
    if cut is None:
        return pairs
    by_id = {id(o): c for o, c in zip(outs, cut)}
    return [(by_id.get(id(o), o), g) for o, g in pairs]


def backward_cut(runner, root: torch.Tensor, outs: list[torch.Tensor],
                 cut: list[torch.Tensor], with_kept) -> None:
    """Backward of a scalar loss given stand-ins: its direct path into the parameters, then
    the gradient it sent the stand-ins through the model from the outputs."""
    live = [(o, c) for o, c in zip(outs, cut) if c.requires_grad and o.requires_grad]
    sent = torch.autograd.grad(root, [c for _, c in live], retain_graph=True,
                               allow_unused=True) if live else ()
    leaves = [*direct_params(runner.model, cut), *trained_loss_params(runner.step)]
    if leaves:
        root.backward(inputs=leaves, retain_graph=True)  # (see Runner._backward)
    pairs = [(o, g) for (o, _), g in zip(live, sent) if g is not None]
    torch.autograd.backward(*with_kept(runner, [o for o, _ in pairs], [g for _, g in pairs]))
