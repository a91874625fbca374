"""The module whose backward hooks a ``BackwardHookFunctionBackward`` node ran, and which kind.

torch wraps a hooked module's inputs and outputs in identity nodes: the inputs' node, made
inside the module's call, runs its ``register_full_backward_hook`` hooks (on grad_input); the
outputs' node runs its ``register_full_backward_pre_hook`` hooks (on grad_output). The
outputs' node is made after the module's forward hooks returned, so the labels of the nodes
by module call give it to the parent (``domain`` for a pre-hook on ``domain.0``): the module
is the one under that label whose own nodes it wraps, and which carries backward hooks.
"""

from __future__ import annotations

from torch import nn

from recorder.compat import forward_hooks

from .twice_differentiated import at_forward_node

# the node torch's BackwardHook wraps a hooked module's inputs and outputs in
NODE = "BackwardHookFunctionBackward"
PRE = "register_full_backward_pre_hook"
FULL = "register_full_backward_hook"


def at_nodes(found, names: dict, model: nn.Module) -> None:
    """After the run that found backward origin ``found`` (a
    :class:`~replay.backward.BackwardOrigin`), whose nodes ``names`` labels by module: made by
    such a node, its ``module`` and ``hook_kind``; then its forward node's facts
    (:func:`~replay.twice_differentiated.at_forward_node`, which lets the node go)."""
    if found.node == NODE and found.node_object is not None:
        found.module, found.hook_kind = hooked_module(found.node_object, found.module, names,
                                                      model)
    at_forward_node(found, names)


def hooked_module(node, name: str | None, names: dict, model: nn.Module) -> tuple[str | None, str]:
    """``(module, registration)`` of the hooks hook node ``node`` (labelled ``name``) ran."""
    modules = dict(model.named_modules())
    own = name if name in modules else None
    for child, _ in node.next_functions:
        inner = names.get(child) if child is not None else None
        for m in _under(inner, own, modules):
            if m != own and _hooked(modules[m]):  # (the outputs' node of m, labelled above it)
                return m, PRE if "backward_pre" in _kinds(modules[m]) else FULL
    return name, FULL


def _under(inner: str | None, own: str | None, modules: dict) -> list[str]:
    """The modules from just below ``own`` down to ``inner`` (outermost first): ``inner`` and
    its ancestors inside ``own`` (every module when ``own`` is None: the root's outputs)."""
    if inner is None or inner not in modules:
        return []
    parts = inner.split(".") if inner else []
    chain = [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return [m for m in chain if own is None or (own == "" and m) or m.startswith(own + ".")]


def _kinds(m: nn.Module) -> set[str]:
    return {kind for kind, _ in forward_hooks(m)}


def _hooked(m: nn.Module) -> bool:
    return bool({"backward_pre", "backward"} & _kinds(m))
