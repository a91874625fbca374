"""The gradient each root output of a re-run received from outside the model, out of the one
recorded for it: an output another output is computed from (the logits beside the loss a
Hugging Face or nanoGPT model returns) was recorded with what that output sent it too."""

from __future__ import annotations

import torch


def external(pairs: list[tuple[torch.Tensor, torch.Tensor]], through_nonfinite: bool = False
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The gradient each root output received from outside the model. An output another
    output is computed from (the logits of a model that returns its loss beside them, as
    Hugging Face and nanoGPT models do) was recorded with the gradient that output sent it
    too: fed both, backward counted that path twice (twice the gradients). Each output keeps
    its recorded gradient less what the outputs computed from it sent it (their own external
    gradients, through every path), and is left out when that is all it had. With
    ``through_nonfinite`` (the recorded forward was non-finite), a recorded non-finite entry
    where they sent something is taken as all theirs: that forward's own backward made it."""
    if len(pairs) < 2:
        return pairs
    outs = [o for o, _ in pairs]
    below = [[k for k, b in enumerate(outs) if k != j and computed_from(b, a)]
             for j, a in enumerate(outs)]
    ext: dict[int, torch.Tensor] = {}
    keep = []
    while len(ext) < len(outs):  # the outputs computed from none of the open ones first
        ready = [j for j in range(len(outs)) if j not in ext and all(k in ext for k in below[j])]
        if not ready:  # (a cycle cannot happen; be safe)
            return pairs
        for j, sent in _sent(outs, ready, below, ext):
            g = pairs[j][1].to(outs[j].dtype)
            if sent is not None:
                if through_nonfinite:
                    g = torch.where(torch.isfinite(g), g, sent.to(g.dtype))
                whole = float(g.double().norm())
                g = (g.double() - sent.double()).to(g.dtype)
                if float(g.double().norm()) <= 1e-3 * whole:
                    g = None  # (all it had came from the outputs computed from it)
            ext[j] = g
            if g is not None:
                keep.append(j)
    return [(outs[j], ext[j]) for j in sorted(keep)] or pairs


def _sent(outs, ready, below, ext):
    """``(j, what the outputs computed from output j sent it)`` for each ``j`` in ``ready``:
    one backward per set of senders, not one per output (a Hugging Face model's logits are
    computed from each layer's cached keys and values: one pass, not one per tensor)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j in ready:
        groups.setdefault(tuple(k for k in below[j] if ext[k] is not None), []).append(j)
    sent: dict[int, torch.Tensor | None] = {}
    for ks, js in groups.items():
        got = torch.autograd.grad([outs[k] for k in ks], [outs[j] for j in js],
                                  [ext[k] for k in ks], retain_graph=True,
                                  allow_unused=True) if ks else [None] * len(js)
        sent.update(zip(js, got))
    return [(j, sent[j]) for j in ready]


def computed_from(b: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``a``'s autograd node is among ``b``'s ancestors (``b`` computed from ``a``)."""
    target, seen = a.grad_fn, set()
    todo = [b.grad_fn]
    if target is None:
        return False
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if fn is target and fn is not b.grad_fn:
            return True
        seen.add(fn)
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return False
