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
        # per open module call: its inputs' newest node number, the older nodes its
        # children's calls stopped at, and which call of its module it is
        self.calls: list[tuple[int, list, int]] = []
        # node -> (which call of its module made it, the calls each module began in that root
        # call): a module called more than once per forward (a shared block) names its call
        self.call_of: dict[Any, tuple[int, dict[str, int]]] = {}
        self._begun: dict[str, int] = {}  # (this micro-batch's: see loss_labeller)
        self.in_backward = False  # (a reentrant checkpoint's forward again: no call of its own)

    def label(self, nodes, name: str, before: int = -1, call: int | None = None) -> list:
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
            if call is not None:
                self.call_of[node] = (call, self._begun)
            self.on_new(node, name)
            todo.extend(n for n, _ in node.next_functions if n is not None)
        return stopped

    def hooks(self, model) -> list:
        # (a TorchScript module takes none: PyTorch's global hooks name the nodes of its call)
        handles = hook_scripted(model, "", outside_transforms(
            lambda _, m, a: self._pre("", m, a, {})), outside_transforms(self._post))
        for name, m in hookable_modules(model):
            handles.append(m.register_forward_pre_hook(outside_transforms(partial(
                self._pre, name)), with_kwargs=True))
            handles.append(m.register_forward_hook(outside_transforms(partial(self._post,
                                                                              name))))
        return handles

    def _pre(self, name: str, module, args, kwargs) -> None:
        call = None
        if not self.in_backward:
            call = self._begun[name] = self._begun.get(name, -1) + 1
        newest = [sequence_nr(n) for n in grad_fns(tensor_leaves([args, kwargs]))]
        self.calls.append((max(newest, default=-1), [], call))

    def backward_ended(self) -> None:
        """A micro-batch's backward ran: the next micro-batch's calls count from 0."""
        self.in_backward, self._begun = False, {}

    def repeated_call(self, node, module: str | None) -> int | None:
        """Which call of ``module`` made ``node`` (labelled by it), when that module ran more
        than once in its micro-batch (else None: the call says nothing), as a forward event's
        call."""
        call, begun = self.call_of.get(node, (None, {}))
        if call is None or self.names.get(node) != module or not begun.get(module, 0):
            return None
        return call

    def _post(self, name: str, module, args, output) -> None:
        before, pending, call = self.calls.pop() if self.calls else (-1, [], None)
        made = grad_fns(tensor_leaves(output)) + kept_on(module, before)
        stopped = self.label(made + pending, name, before, call)
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


def loss_labeller(runner: Runner, labels: NodeLabels):
    """The backward's context: labels the loss's autograd nodes ``<loss>`` just before backward
    runs, and keeps the forward traceback of nodes created during it; after it, the next
    micro-batch's module calls are counted from 0."""
    @contextlib.contextmanager
    def ctx():
        labels.label(grad_fns(tensor_leaves(runner.last_loss)), "<loss>")
        for name, t in runner.kept:  # (values the forward kept aside: replay.kept_aside)
            labels.label(grad_fns([t]), name.rpartition(".")[0])
        # Nodes made during backward (reentrant checkpointing re-runs its blocks' forward
        # there) get their source line too; NaN must not raise before the hooks see it.
        labels.in_backward = True
        try:
            with node_tracebacks():
                yield
        finally:
            labels.backward_ended()

    return ctx
