"""Which module's forward made each autograd node (:class:`NodeLabels`), and the backward's
context that labels the loss's nodes ``<loss>`` (:func:`loss_labeller`): how a backward origin
found at a node is named by its module."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from recorder.capture import tensor_leaves
from recorder.scripted import hook_scripted, hookable_modules

from .compat import sequence_nr
from .source import node_tracebacks
from .transforms import outside_transforms

if TYPE_CHECKING:
    from .rerun import Runner

__all__ = ["NodeLabels", "grad_fns", "loss_labeller"]


class NodeLabels:
    """Which module's forward made each autograd node: the innermost module whose call made
    it. A module's call made the nodes behind its outputs that are newer than its inputs'
    (node numbers grow as nodes are made); older ones it meets there were made by its
    parent's own code (a custom ``autograd.Function`` applied between two layers, say) and
    are left to the parent's call. ``on_new(node, name)`` runs once per node labelled."""

    def __init__(self, on_new):
        self.on_new = on_new
        self.names: dict[Any, str] = {}
        # per open module call: its inputs' newest node number, and the older nodes its
        # children's calls stopped at
        self.calls: list[tuple[int, list]] = []

    def label(self, nodes, name: str, before: int = -1) -> list:
        """Label the nodes behind ``nodes`` newer than node number ``before``; returns the
        unlabelled older ones it stopped at."""
        todo, stopped = list(nodes), []
        while todo:
            node = todo.pop()
            if node is None or node in self.names:
                continue
            if sequence_nr(node) <= before:
                stopped.append(node)
                continue
            self.names[node] = name
            self.on_new(node, name)
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return stopped

    def hooks(self, model) -> list:
        # (a TorchScript module takes none: PyTorch's global hooks name the nodes of its call)
        handles = hook_scripted(model, "", outside_transforms(lambda _, m, a: self._pre(m, a, {})),
                                outside_transforms(self._post))
        for name, m in hookable_modules(model):
            handles.append(m.register_forward_pre_hook(outside_transforms(self._pre),
                                                       with_kwargs=True))
            handles.append(m.register_forward_hook(outside_transforms(partial(self._post,
                                                                              name))))
        return handles

    def _pre(self, module, args, kwargs) -> None:
        newest = [sequence_nr(n) for n in grad_fns(tensor_leaves([args, kwargs]))]
        self.calls.append((max(newest, default=-1), []))

    def _post(self, name: str, module, args, output) -> None:
        before, pending = self.calls.pop() if self.calls else (-1, [])
        made = grad_fns(tensor_leaves(output)) + kept_on(module, before)
        stopped = self.label(made + pending, name, before)
        if self.calls:
            self.calls[-1][1].extend(stopped)
        else:  # made before the model's forward (from its inputs): the root's, as before
            self.label(stopped, name)


def kept_on(module, before: int) -> list:
    """The nodes behind the tensors this call of ``module`` kept on its own attributes (an
    attention's ``self.entropy``, a mixture-of-experts layer's ``self.aux_loss``, a VAE
    encoder's ``self.kl``) newer than its inputs: its own code made them, though no output
    leads to them (the parent adds them to the loss), so they are named by it, not by the
    caller whose graph reaches them first."""
    return [n for n in grad_fns(v for v in vars(module).values() if isinstance(v, torch.Tensor))
            if sequence_nr(n) > before]


def grad_fns(tensors) -> list:
    """The autograd nodes that made ``tensors`` (those that have one)."""
    return [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn]


def loss_labeller(runner: Runner, label):
    """The backward's context: labels the loss's autograd nodes ``<loss>`` just before backward
    runs, and keeps the forward traceback of nodes created during it."""
    @contextlib.contextmanager
    def ctx():
        label(grad_fns(tensor_leaves(runner.last_loss)), "<loss>")
        for name, t in runner.kept:  # (values the forward kept aside: replay.kept_aside)
            label(grad_fns([t]), name.rpartition(".")[0])
        # Nodes made during backward (reentrant checkpointing re-runs its blocks' forward
        # there) get their source line too; NaN must not raise before the hooks see it.
        with node_tracebacks():
            yield

    return ctx
