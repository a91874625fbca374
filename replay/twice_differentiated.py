"""A backward event of a step whose forward differentiated itself with ``create_graph=True``
(an interatomic potential's forces ``-autograd.grad(E, pos)``, a gradient penalty), so the
loss's backward differentiates the forward's ops twice. The node that made the value may be
one of that first derivative's (``DivBackward0`` of the norm's gradient, made at the
``autograd.grad`` line): it is named at the forward op whose derivative made it (its module
and line, where the fix goes). And at a sqrt's or a norm's 0, ``torch.linalg.vector_norm``
is no fix: its gradient, masked to 0 at a zero vector, is 0/0 to differentiate again (not
said of a forward node that saved a NaN, a masked branch's op outside its domain: the mask's
fix is the one).
A forward node the forward's derivative never ran (an op of the loss, after it) is no such
node: its pole is a first derivative's (a rollout loss's Euclidean distance at a trajectory's
own start, 0), whatever the step differentiated elsewhere.
Non-reentrant activation checkpointing (``checkpoint(layer, h, use_reentrant=False)``) also
makes nodes inside the backward: the block's forward, re-run where its saved tensors are
unpacked. Those are forward nodes, never a derivative's: told by their creation stack."""

from __future__ import annotations

import os

import torch

from .cause_text import DO

__all__ = ["at_forward_node", "derived", "forward_node", "twice_hint"]

TWICE = ("; this step differentiates the forward again (its autograd.grad with "
         "create_graph=True: forces -dE/dpos, a gradient penalty), so the op needs a finite "
         "second derivative there: torch.linalg.vector_norm's gradient, masked to 0 at a zero "
         "vector, is 0/0 to differentiate again; take sqrt(x + eps) (PaiNN's 1e-8) or keep "
         "the zero vectors out of the op's input")


def forward_node(node):
    """The forward node whose derivative made ``node`` (anomaly mode's ``parent_``, followed
    up to a node made in the forward); ``node`` itself when it was made there."""
    while (parent := _parent(node)) is not None:
        node = parent
    return node


def derived(node) -> bool:
    """Whether a backward with ``create_graph=True`` made ``node`` (under anomaly mode)."""
    return _parent(node) is not None


def _parent(node):
    """The node whose backward made ``node``; None for a custom Function's (reentrant
    checkpointing re-runs its block's forward there: forward nodes, not a derivative's), and
    for a node non-reentrant checkpointing's recomputation made (:func:`_recomputed`)."""
    try:
        meta = getattr(node, "metadata", None) or {}
    except RuntimeError:  # (a node that cannot hold metadata)
        return None
    parent = meta.get("parent_")
    if parent is None or isinstance(parent, torch.autograd.function.BackwardCFunction):
        return None
    return None if _recomputed(meta.get("traceback_")) else parent


def _recomputed(stack) -> bool:
    """Whether anomaly mode's creation stack of a node runs through the unpack hook of
    ``torch.utils.checkpoint`` (the non-reentrant variant's recomputation of the forward)."""
    frames = stack if isinstance(stack, (list, tuple)) else str(stack or "").splitlines()
    return any(_CHECKPOINT_FILE in str(f) and "unpack_hook" in str(f) for f in frames)


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def at_forward_node(b, names: dict) -> None:
    """After the run that found backward origin ``b``, whose nodes ``names`` labels by
    module: whether the graph held a derivative's nodes, and ``b``'s module and
    ``derivative_of`` (the node itself until then) from the forward node that made it."""
    b.twice = any(derived(node) for node in names) and (
        b.derivative_of is not None or _differentiated(b.node_object, names))
    b.node_object = None
    if b.derivative_of is not None:
        fwd = forward_node(b.derivative_of)
        b.module, b.derivative_of = names.get(fwd, b.module), fwd.name()


def _differentiated(node, names: dict) -> bool:
    """Whether the forward's own derivative ran forward node ``node``'s backward (a derived
    node's parent is it: the energy's sqrt under the forces' ``autograd.grad``). One that ran
    after it, on its output (a rollout loss's distance, the norm of a gradient penalty's
    gradient), is differentiated once: its pole is a first derivative's, no second's."""
    return node is None or any(_parent(n) is node for n in names)


def twice_hint(b, hint: str) -> str:
    """``hint`` of backward origin ``b`` when its step differentiated the forward twice:
    whose derivative made the node, and the sqrt advice that holds for a second derivative
    (``DO["sqrt_pole"]``'s vector_norm does not)."""
    if not b.twice:
        return hint
    if b.derivative_of is not None:
        hint = (f"{b.node} is a node of the derivative the forward took of its "
                f"{b.derivative_of} (at {b.source}); {hint}")
    sqrt_like = any(w in (b.derivative_of or b.node or "").lower() for w in ("sqrt", "norm"))
    # (a forward node that saved a NaN ran outside its domain in a masked branch: a porous
    # medium's where(u > 0, sqrt(u), 0) in a PINN's residual; the mask's fix holds, the second
    # derivative's advice about a zero vector does not)
    if not sqrt_like or (b.saved == "nan" and b.derivative_of is None):
        return hint
    return hint.replace(DO["sqrt_pole"], "") + TWICE
