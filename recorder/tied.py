"""Parameters the model reaches under two names: a head tied to the embedding
(``lm_head.weight = tok_emb.weight``), one ``nn.Parameter`` given to two layers, a module
used twice (``nn.Sequential(lin, act, lin)``). The bundle holds each tensor once, under the
name ``named_parameters()`` gives it first; ``tied_params`` maps each other name to that one,
so the replay can tie a factory's model that holds them apart as the run did
(``replay.retie``)."""

from __future__ import annotations

from torch import nn

from .compiled import eager_name


def tied_params(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` of each parameter reached under more than one name."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:
            continue
        name = eager_name(name)
        if (src := first.setdefault(id(p), name)) != name:
            tied[name] = src
    return tied


def aliases_of(tied: dict[str, str], name: str) -> list[str]:
    """The other names of parameter ``name`` (its first name or an alias) under ``tied``
    (:func:`tied_params`' map)."""
    first = tied.get(name, name)
    names = [first, *(a for a, src in tied.items() if src == first)]
    return [n for n in names if n != name] if len(names) > 1 else []


def tied_words(others: list[str]) -> str:
    """The words after a tied parameter's name: `` (one tensor with lm_head.weight: tied)``."""
    return f" (one tensor with {', '.join(others)}: tied)" if others else ""
