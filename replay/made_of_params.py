"""Which of the model's parameters an op's inputs were made of, when they were made of the
weights alone (``Evidence.of_weights``) through ops that change values: a Cholesky factor
``tril(off, -1) + diag_embed(d)`` whose diagonal ``log(diag(L))`` takes, once an update
stepped ``d`` through 0. ``replay.param_names`` names a parameter an op took as it is, or an
unchanged copy of it; this names them through any op, from the autograd graph of the inputs
(the parameters its ``AccumulateGrad`` leaves hold), so that the hint says which parameters
left the op's domain instead of 'the model's parameters'."""

from __future__ import annotations

import torch

ALONE = "made from the model's parameters and buffers alone"
SHOWN = 4  # parameters named


def made_of(ins: list, params: dict) -> list[str]:
    """The names (``params``: ``(data_ptr, shape)`` -> name, as ``ParamNames.params``) of
    the parameters the autograd graphs of ``ins`` reach, in the order first reached."""
    names: list[str] = []
    seen: set[int] = set()
    stack = [t.grad_fn for t in ins if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stack += [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad
              and t.grad_fn is None]  # (a parameter taken as it is)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        leaf = node if isinstance(node, torch.Tensor) else getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            try:
                name = params.get((leaf.data_ptr(), tuple(leaf.shape)))
            except RuntimeError:  # (a tensor without storage)
                continue
            if name is not None and name not in names:
                names.append(name)
            continue
        stack.extend(nxt for nxt, _ in getattr(node, "next_functions", ()) if nxt is not None)
    return names


def params_hint(hint: str | None, hit) -> str | None:
    """``hint`` naming the parameters ``hit``'s evidence says its op's inputs were made of."""
    ev = getattr(hit, "evidence", None)
    return with_params(hint, ev.made_of) if hint and ev is not None else hint


def with_params(text: str, names: list[str]) -> str:
    """``text`` (the advice of an op on the weights alone) naming ``names`` where it says
    the inputs were made of the parameters."""
    if not names or ALONE not in text:
        return text
    shown = ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
    what = "the parameter" if len(names) == 1 else "the parameters"
    return text.replace(ALONE, f"{ALONE} (here of {what} {shown})", 1)
