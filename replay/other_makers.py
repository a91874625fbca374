"""The other backward nodes that made a non-finite gradient from finite ones in the same pass.

The backward origin is the first node to do so. A model may hold the same pole at several
places: kbc's ComplEx returns ``sqrt(re^2 + im^2)`` of the head and of the tail for N3, and a
coordinate dropout zeroed in both parts is a pole of either; the tail's node runs first in
backward and is named, its samples alone, and dropping them leaves the head's NaN (``--try
auto``'s ``drop`` came back NaN). The model's nodes are watched in one more re-run; the others
are named (``origin["also"]``: node, source line, samples), and ``drop`` drops them too.

A custom Function whose backward runs the model's modules again (torchdiffeq's
``odeint_adjoint``, which solves the adjoint ODE with the field's vjp; reentrant activation
checkpointing) returns what a node inside that backward made: the origin, when it is one of
those, so the Function is not named beside it (dropping the origin's samples is the fix).

A node that saved a NaN for its backward made nothing: it passes on a NaN an earlier pass
made (PaiNN's forces, ``autograd.grad(create_graph=True)`` in the forward, whose graph holds
the sqrt's 0/0 gradient at a zero vector: the loss's backward through it returns NaN from
finite gradients at every node that saved that value), so it is not named.
"""

from __future__ import annotations

from typing import Any

import torch

from recorder.capture import tensor_leaves
from recorder.finite import finite
from recorder.samples import Samples
from recorder.scripted import hookable_modules

from .backward import saved_facts
from .grad_rows import batch_rows
from .node_labels import grad_fns
from .rerun import Runner
from .source import node_source, node_tracebacks
from .transforms import outside_transforms
from .twice_differentiated import forward_node

__all__ = ["add_others", "drop_with_others", "other_makers"]

MAX_OTHERS = 3


def other_makers(runner: Runner, where: Samples, node: str | None, source: str | None
                 ) -> list[dict[str, Any]]:
    """The nodes of the model's graph other than the origin (``node`` at ``source``) whose
    incoming gradients were finite and returned ones were not, in the order backward ran
    them, one entry per node name and line (samples merged); at most ``MAX_OTHERS``."""
    hits: dict[tuple[str, str | None], list[int]] = {}
    hooked: set[int] = set()
    handles: list = []
    calls, entered = [0], {}  # (module calls so far; at each node's backward's start)

    def on_node(fn) -> None:
        def enter(grad_outputs):
            entered[id(fn)] = calls[0]

        def hook(grad_inputs, grad_outputs):
            incoming = [g for g in grad_outputs if isinstance(g, torch.Tensor)]
            returned = [g for g in grad_inputs if isinstance(g, torch.Tensor)]
            # (a backward that ran the model's modules again carries out what they made)
            reran = calls[0] > entered.get(id(fn), calls[0])
            if all(finite(g) for g in incoming) and not all(finite(g) for g in returned) \
                    and saved_facts(fn)[0] != "nan" and not reran:
                # (a derivative's node at its forward op's line, as the origin is named)
                key = (fn.name(), node_source(forward_node(fn)) or node_source(fn))
                rows = batch_rows(fn, list(grad_inputs), where)
                hits[key] = sorted(set(hits.get(key, [])) | set(rows))
        handles.append(fn.register_hook(hook))
        handles.append(fn.register_prehook(enter))

    def walk(fns) -> None:
        todo = list(fns)
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in hooked:
                continue
            hooked.add(id(fn))
            on_node(fn)
            todo.extend(f for f, _ in fn.next_functions)

    def count(*_) -> None:
        calls[0] += 1

    def hooks(model):
        return [model.register_forward_hook(
            outside_transforms(lambda m, args, out: walk(grad_fns(tensor_leaves(out))))),
            *(m.register_forward_pre_hook(outside_transforms(count))
              for _, m in hookable_modules(model))]

    try:
        runner.run(instrument=False, forward_ctx=node_tracebacks, hooks=hooks)
    finally:
        for h in handles:
            h.remove()
    others = [{"node": n, "source": s, "samples": rows} for (n, s), rows in hits.items()
              if (n, s) != (node, source)]
    return others[:MAX_OTHERS]


def add_others(report: dict[str, Any], runner: Runner, where: Samples, node: str | None,
               source: str | None) -> None:
    """Name in ``report`` the other nodes than its backward origin's (see the module)."""
    if node is None:
        return
    also = other_makers(runner, where, node, source)
    if also:
        report["origin"]["also"] = also
        report["problems"].append(also_note(report["origin"]))


def drop_with_others(origin: dict[str, Any]) -> list[int]:
    """The samples ``--try drop`` drops: the origin's and those of the other nodes."""
    rows = set(origin.get("samples") or [])
    for other in origin.get("also") or []:
        rows |= set(other.get("samples") or [])
    return sorted(rows)


def also_note(origin: dict[str, Any]) -> str | None:
    """The report's note naming the other nodes, or None."""
    also = origin.get("also")
    if not also:
        return None
    named = "; ".join(f"{a['node']} at {a['source'] or 'an unknown line'} in samples "
                      f"{a['samples']}" for a in also)
    return (f"other backward nodes made a non-finite gradient from finite ones in the same "
            f"pass: {named}; the fix is needed there too (dropping the samples named above "
            "alone leaves those)")
