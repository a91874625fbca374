"""The state of an optimizer wrapper's inner optimizer, kept beside the wrapper's own.

Lookahead (timm's, and the copies of it) steps a base optimizer it holds as an attribute and
keeps only its slow weights in its own ``state``; the base optimizer's moments (Adam's
``exp_avg``, ``exp_avg_sq``) live in ``wrapper.base.state``. Recorded by ``wrapper.state``
alone, a bundle and a rewind copy lacked them, and a re-run's Adam started from zero moments.
Shared by both packages: each inner optimizer's per-parameter entries are keyed
``<attribute>::<key>`` beside the wrapper's own keys (``base::exp_avg``).

An inner optimizer may hold fewer parameters than its wrapper: ``ZeroRedundancyOptimizer``'s
``optim`` (its ``optimizer_class``) holds only this rank's shard of the parameters, and so its
state (ZeRO-1). :func:`describe_inner` writes which class and which parameters, so that the
replay rebuilds that class over every parameter with the shards of every rank's bundle.
"""

from __future__ import annotations

from typing import Any

import torch

SEP = "::"


def inner_optimizers(opt) -> list[tuple[str, torch.optim.Optimizer]]:
    """(attribute, optimizer) of each optimizer ``opt`` holds as a plain attribute (a
    wrapper's base optimizer), itself excluded."""
    try:
        attrs = vars(opt)
    except TypeError:
        return []
    return [(k, v) for k, v in attrs.items()
            if isinstance(v, torch.optim.Optimizer) and v is not opt and SEP not in k]


def describe_inner(opt, names: dict[int, str]) -> dict[str, Any]:
    """``{attribute: {"class", "params", "sharded"}}`` of each inner optimizer: its class's
    import path, the names of the parameters it holds (``names``: id -> name) and whether
    they are fewer than the wrapper's (its state is this process's shard)."""
    outer = {id(p) for g in opt.param_groups for p in g["params"]}
    out = {}
    for attr, inner in inner_optimizers(opt):
        held = [p for g in inner.param_groups for p in g["params"]]
        cls = type(inner)
        out[attr] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                     "params": [names[id(p)] for p in held if id(p) in names],
                     "sharded": bool(outer - {id(p) for p in held})}
    return out


def full_state(opt, p) -> dict[str, Any]:
    """``p``'s state in ``opt`` and in its inner optimizers (their keys prefixed)."""
    st = dict(opt.state.get(p, {}))
    for attr, inner in inner_optimizers(opt):
        st.update({f"{attr}{SEP}{k}": v for k, v in inner.state.get(p, {}).items()})
    return st


def state_items(opt) -> list[tuple[Any, dict[str, Any]]]:
    """(parameter, :func:`full_state`) of every parameter that has state anywhere."""
    seen = {id(p): p for p in opt.state}
    for _, inner in inner_optimizers(opt):
        seen.update({id(p): p for p in inner.state})
    return [(p, full_state(opt, p)) for p in seen.values()]


def put_state(opt, p, state: dict[str, Any]) -> None:
    """Set ``p``'s state, the prefixed entries into the inner optimizer they name (an entry
    for an inner optimizer ``opt`` does not have is dropped)."""
    inner = dict(inner_optimizers(opt))
    own: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for k, v in state.items():
        attr, sep, key = k.partition(SEP)
        if sep and attr in inner:
            parts.setdefault(attr, {})[key] = v
        elif not sep:
            own[k] = v
    opt.state[p] = own
    for attr, st in parts.items():
        inner[attr].state[p] = st


def clear_state(opt) -> None:
    opt.state.clear()
    for _, inner in inner_optimizers(opt):
        inner.state.clear()
